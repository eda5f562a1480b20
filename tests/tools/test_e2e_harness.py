"""The e2e harness (tests/e2e/engine.py) takes the engine's dtype, eager mode, attention
backend and environment from the device the tests run on (FORK_DEVICE, which
`./fork test --device` sets): on the CPU float32, eager, CPU_MLA and vLLM's CPU
variables, as always; on CUDA none of them, so vLLM chooses. Each device in a fresh
interpreter with a stand-in `vllm.LLM` that records its arguments (no engine starts:
what is checked is what the harness asks vLLM for)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, os, sys, types
recorded = {}
class LLM:
    def __init__(self, **kwargs):
        recorded.update(kwargs)
sys.modules["vllm"] = types.SimpleNamespace(LLM=LLM)
from tests.e2e import engine
# An MLA model's arguments (MLA_ARGS; CPU_MLA_ARGS in a harness without it).
mla = getattr(engine, "MLA_ARGS", engine.CPU_MLA_ARGS)
engine.make_llm("/m", enable_chunk_cache=True, **mla)
cpu_env = sorted(k for k in os.environ if k.startswith("VLLM_CPU_"))
print(json.dumps({"llm": recorded, "cpu_env": cpu_env}))
"""


def _harness(device: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    env.pop("FORK_DEVICE", None)
    if device is not None:
        env["FORK_DEVICE"] = device
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("device", ["cpu", None])
def test_the_cpu_engine_is_float32_eager_cpu_mla(device):
    got = _harness(device)
    assert got["llm"] == {
        "model": "/m",
        "max_model_len": 4096,
        "seed": 0,
        "dtype": "float32",
        "enforce_eager": True,
        "enable_chunk_cache": True,
        "attention_backend": "CPU_MLA",
    }
    assert got["cpu_env"] == ["VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"]


def test_the_cuda_engine_is_what_vllm_chooses():
    got = _harness("cuda")
    assert got["llm"] == {
        "model": "/m",
        "max_model_len": 4096,
        "seed": 0,
        "enable_chunk_cache": True,
    }
    assert got["cpu_env"] == []
