"""Run pytest with the fused load kernel forced off (every layer takes the per-layer load):
    python tools/gpu/no_fused.py PYTEST_ARGS...
In-process engines only (the e2e modules set VLLM_ENABLE_V1_MULTIPROCESSING=0)."""

import sys

import pytest

from vllm.v1.worker import fused_chunk_load

fused_chunk_load.available = lambda: False
sys.exit(pytest.main(sys.argv[1:]))
