"""An in-process offline vLLM engine for e2e tests (one per test module), set up for
the device the tests run on (FORK_DEVICE, which `./fork test --device` sets; cpu where
unset).

CPU: float32, eager, vLLM's CPU variables (ENGINE_ENV), CPU_MLA for MLA models. CUDA:
what vLLM chooses itself: the model's half-precision dtype (bf16 or fp16 for a float32
checkpoint), torch.compile with CUDA graphs (the chunk cache narrows the graph mode
where it must: setup._resolve_cudagraph_mode) and the attention backend.
"""

from __future__ import annotations

import contextlib
import gc
import os

DEVICE = os.environ.get("FORK_DEVICE", "cpu")
ON_CPU = DEVICE == "cpu"
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
if ON_CPU:
    ENGINE_ENV.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
                "VLLM_CPU_OMP_THREADS_BIND", "0,1"
            ),
        }
    )
# NOTE: on the CPU bfloat16 is 3-6x slower on AVX2 and a compiled graph costs a minute
# at every start (docs/building.md); float32 also lets the exactness tests compare with
# a fixed tolerance. On a GPU vLLM's own choices are what is tested.
DEVICE_ARGS: dict = {"dtype": "float32", "enforce_eager": True} if ON_CPU else {}
# NOTE (issue 59): vLLM 0.32 serves an MLA model with AMX_MLA wherever the CPU has AMX
# tiles (`CpuPlatform.get_attn_backend_cls`: "Prefer AMX when available, unless CPU_MLA
# was explicitly requested"), and CPU_MLA elsewhere. AMX_MLA takes bf16 only, cannot
# pack the tiny DeepSeek's 16-wide qk_nope/v dims ("invalid weight input features 16")
# and has no latent writer in the chunk cache: the MLA tests ask for CPU_MLA by name, so
# they run the same backend on every x86 CPU
# (tests/unit/distributed/test_chunk_cache_amx_mla.py forces the AMX branch and checks
# these arguments against vLLM's own selection).
CPU_MLA_ARGS = {"attention_backend": "CPU_MLA"}
# An MLA model's backend: CPU_MLA on the CPU (above), vLLM's choice on a GPU.
MLA_ARGS = CPU_MLA_ARGS if ON_CPU else {}


def make_llm(model: str, **kwargs):
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    from vllm import LLM

    args = dict(model=model, max_model_len=4096, seed=0, **DEVICE_ARGS)
    args.update(kwargs)
    return LLM(**args)


def close_llm(llm) -> None:
    # Best effort at teardown.
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def chunk_scheduler(llm):
    """The scheduler half of the chunk cache in an in-process engine (its
    manager owns every counter the tests read through `manager.stats()`)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.chunk_scheduler
