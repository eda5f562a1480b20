"""An in-process offline vLLM engine for e2e tests (one per test module)."""

from __future__ import annotations

import gc
import os

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0,1"),
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
# NOTE (issue 59): vLLM 0.32 serves an MLA model with AMX_MLA wherever the CPU has AMX
# tiles (`CpuPlatform.get_attn_backend_cls`: "Prefer AMX when available, unless CPU_MLA
# was explicitly requested"), and CPU_MLA elsewhere. AMX_MLA takes bf16 only, cannot pack
# the tiny DeepSeek's 16-wide qk_nope/v dims ("invalid weight input features 16") and has
# no latent writer in the chunk cache: the MLA tests ask for CPU_MLA by name, so they run
# the same backend on every x86 CPU (tests/unit/distributed/test_chunk_cache_amx_mla.py
# forces the AMX branch and checks these arguments against vLLM's own selection).
CPU_MLA_ARGS = {"attention_backend": "CPU_MLA"}


def make_llm(model: str, **kwargs):
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    from vllm import LLM

    args = dict(
        model=model, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0
    )
    args.update(kwargs)
    return LLM(**args)


def close_llm(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass
    del llm
    gc.collect()


def chunk_scheduler(llm):
    """The scheduler half of the chunk cache in an in-process engine (its
    manager owns every counter the tests read through `stats()`)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.chunk_scheduler
