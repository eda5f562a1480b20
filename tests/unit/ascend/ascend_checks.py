"""Runs the Ascend check scripts, each in its own process with the stub `torch_npu`
and the patched vllm-ascend tree on PYTHONPATH, vLLM on its CPU platform."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_check(script: str, check: str, ascend_tree: Path, *args: str,
              first: Path | None = None, timeout: int = 600) -> str:
    """Run `check` of `script` (a file next to this one); returns its stdout."""
    path = [str(HERE / "stubs"), str(ascend_tree)]
    if first is not None:
        path.insert(0, str(first))
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(path),
           "VLLM_LOGGING_LEVEL": "WARNING",
           # vLLM stays on its CPU platform (the tree's metadata would activate
           # vllm-ascend's NPU platform, which needs a real torch_npu device).
           "VLLM_PLUGINS": "none"}
    proc = subprocess.run([sys.executable, str(HERE / script), check, *args],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and f"OK {check}" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-5000:])
    return proc.stdout
