"""Issue 29, finding 1: a chunked request under vllm-ascend's balance scheduler, whose
schedule() is its own copy of vLLM's (balance scheduling on). Before, it never added
the chunk cache's children (vLLM's schedule() did), so the request waited forever;
now EngineCore adds them before every schedule() (patch 0006), whatever class runs.

One CPU engine in a subprocess (ascend_scheduler_run.py) with vllm-ascend's real
plugin entry point and patch modules and the stub `torch_npu`; no NPU op runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import models_dir
from tests.e2e.engine import ENGINE_ENV

pytestmark = pytest.mark.e2e

STUBS = Path(__file__).resolve().parents[1] / "unit" / "ascend" / "stubs"


def test_chunked_requests_are_served_under_the_balance_scheduler(ascend_tree: Path):
    env = {
        **os.environ,
        **ENGINE_ENV,
        "VLLM_LOGGING_LEVEL": "WARNING",
        "PYTHONPATH": os.pathsep.join([str(STUBS), str(ascend_tree)]),
        # vLLM stays on its CPU platform (vllm-ascend's needs a real NPU).
        "VLLM_PLUGINS": "none",
    }
    script = Path(__file__).with_name("ascend_scheduler_run.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(models_dir() / "tiny-llama")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["scheduler"] == (
        "vllm_ascend.patch.platform.patch_balance_schedule.BalanceScheduler"
    )
    assert result["balance"] is True  # its own schedule() ran, not vLLM's
    first = result["outputs"][0]
    assert first["steps"] is not None, f"the chunked request never finished: {first}"
    second = result["outputs"][1]
    assert first["finish_reason"] == "length" and len(first["token_ids"]) == 4
    assert second["steps"] is not None and len(second["token_ids"]) == 4, second
    # Three children for the first request (system and two documents), one for
    # the second (its system prompt: its document is in the pool, loaded).
    assert result["stats"]["child_computes"] == 4, result["stats"]
    assert result["stats"]["hits"] >= 1 and result["stats"]["tokens_loaded"] > 0
