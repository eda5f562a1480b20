"""device: which accelerator `./fork` builds and sets up for (`--device`, else detected).

cuda where `nvidia-smi -L` lists a GPU, cpu otherwise. NOTE: no NPU detection: the Ascend
route (`./fork build --device npu`) builds sources for a CANN machine and is always asked for
by name.
"""

from __future__ import annotations

import shutil
import subprocess

# `./fork build` also takes "npu" (tools/forktool/ascend_build.py); setup/serve/test/env
# build a venv, which exists for these two.
VENV_DEVICES = ("cpu", "cuda")


def detect() -> str:
    """"cuda" if `nvidia-smi -L` lists at least one GPU, else "cpu"."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    # NOTE: a machine with the driver's tools but no usable GPU exits non-zero or lists none
    # ("No devices found."); each GPU is one "GPU <n>: <name> (UUID: ...)" line.
    if done.returncode != 0:
        return "cpu"
    return "cuda" if any(line.startswith("GPU ") for line in done.stdout.splitlines()) else "cpu"
