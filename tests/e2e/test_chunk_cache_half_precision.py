"""Half-precision exactness of the chunk cache (issue 8, deliverable 4).

vLLM with the chunk cache in bf16/fp16 is compared with the HF float32 forward
under the chunk-isolation mask (the oracle of test_chunk_cache_exactness.py).
Half precision has no fixed tolerance of its own, so the bound is anchored on a
control measured in the same run: stock vLLM (no chunk cache) on the same model
and dtype against the HF float32 *causal* forward over the same token ids. The
chunk cache adds the pool round trip (K/V stored in the model dtype), the fp32
re-rotation of K by the position delta and the cast back; it must not make
things worse than half precision itself does: its worst |logprob diff| over
the top-5 tokens of every step must stay within 3x the control's.

On CPU this runs for bf16 (fp16 is not a CPU dtype of vLLM). On a GPU,
CHUNK_HALF_DTYPES=bfloat16,float16 and CHUNK_HALF_EAGER=0 (default compilation:
torch.compile + piecewise CUDA graphs) or 1 (--enforce-eager); docs/gpu.md.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.conftest import models_dir
from tests.e2e.chunk_reference import Layout, Reference, random_text
from tests.e2e.engine import close_llm, make_llm

pytestmark = pytest.mark.e2e

SMOL = str(models_dir() / "SmolLM2-135M-Instruct")
MODEL = os.environ.get("CHUNK_HALF_MODEL", SMOL)
DTYPES = os.environ.get("CHUNK_HALF_DTYPES", "bfloat16").split(",")
EAGER = os.environ.get("CHUNK_HALF_EAGER", "1") == "1"
NUM_GEN = 4
FACTOR = 3.0


def _engine_kwargs(dtype: str) -> dict:
    kwargs = dict(dtype=dtype, enforce_eager=EAGER)
    if os.environ.get("CHUNK_HALF_BACKEND"):  # e.g. TRITON_ATTN on a GPU
        kwargs["attention_backend"] = os.environ["CHUNK_HALF_BACKEND"]
    if os.environ.get("CHUNK_HALF_KV_DTYPE"):  # e.g. fp8 on a GPU (both engines)
        kwargs["kv_cache_dtype"] = os.environ["CHUNK_HALF_KV_DTYPE"]
    if os.environ.get("CHUNK_HALF_GPU_UTIL"):
        # Two engines one after the other in one process on a GPU.
        kwargs["gpu_memory_utilization"] = float(os.environ["CHUNK_HALF_GPU_UTIL"])
    return kwargs


def _layouts(reference: Reference) -> list[Layout]:
    rng = random.Random("half-precision")
    docs = [random_text(rng, rng.randint(20, 60)) for _ in range(6)]
    out = []
    for step in range(2):  # cold, then warm (the same documents reordered)
        for _ in range(3):
            chunks = rng.sample(docs[:4] if step == 0 else docs[:4], rng.randint(2, 4))
            rng.shuffle(chunks)
            out.append(Layout("answer from the documents", chunks,
                              random_text(rng, rng.randint(3, 10))))
    return out


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _pool_bytes() -> int:
    """Bytes of the pool tensors the (in-process) worker allocated: K and V of
    standard attention layers, the latent rows of MLA layers."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()._worker
    return (sum(t.nbytes for t in worker.pool_key.values())
            + sum(t.nbytes for t in worker.pool_value.values())
            + sum(latent.pool.nbytes for latent in worker.latent.values()))


def _load_buffer_bytes(llm) -> tuple[int, int]:
    """The load buffers' share of the KV budget, and what the worker allocated
    (at most that: its buffers hold --max-chunk-load-tokens rows, never more)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        load_scratch_bytes,
    )

    buffers = get_kv_transfer_group()._worker._scratch._buffers.values()
    return load_scratch_bytes(llm.llm_engine.vllm_config), sum(b.nbytes for b in buffers)


def _kv_bytes_per_token(llm) -> int:
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        kv_bytes_per_token,
    )

    return kv_bytes_per_token(llm.llm_engine.vllm_config)


def _worst(ref, completion) -> float:
    worst = 0.0
    for step, lps in enumerate(completion.logprobs):
        for t, lp in lps.items():
            worst = max(worst, abs(lp.logprob - float(ref[step][t])))
    return worst


@pytest.fixture(scope="module")
def reference():
    return Reference(MODEL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_half_precision_chunk_cache_within_3x_of_stock_vllm(reference, dtype):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    layouts = _layouts(reference)
    params = SamplingParams(max_tokens=NUM_GEN, temperature=0.0, logprobs=5,
                            ignore_eos=True)
    prompts = [reference.chunked_prompt(layout) for layout in layouts]

    llm = make_llm(MODEL, enable_chunk_cache=True, chunk_context="sink",
                   **_engine_kwargs(dtype))
    try:
        chunk_worst = 0.0
        # Cold batch, then warm batch (loads from the pool at new positions).
        for batch in (layouts[:3], layouts[3:]):
            outs = llm.generate([layout.prompt for layout in batch], params,
                                use_tqdm=False)
            for layout, out in zip(batch, outs):
                prompt = reference.chunked_prompt(layout)
                assert list(out.prompt_token_ids) == prompt.token_ids
                assert out.num_cached_tokens == prompt.question_span.start
                completion = out.outputs[0]
                ref = reference.next_token_logprobs(prompt, "sink",
                                                    list(completion.token_ids))
                chunk_worst = max(chunk_worst, _worst(ref, completion))
        chunk_kv_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        # NOTE: 128 tokens on the CPU, 16 for MLA there (CPU_MLA): as the engine chose.
        block = llm.llm_engine.vllm_config.cache_config.block_size
        pool_bytes = _pool_bytes()
        scratch_bytes, scratch_allocated = _load_buffer_bytes(llm)
    finally:
        close_llm(llm)

    if not EAGER:
        # A second engine in one process: vLLM's compile monitor forbids CUDA
        # graph capture after the first engine's capture ended.
        from vllm.compilation import monitor

        monitor.cudagraph_capturing_enabled = True
    llm = make_llm(MODEL, **_engine_kwargs(dtype))
    try:
        control_worst = 0.0
        outs = llm.generate([TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts],
                            params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            completion = out.outputs[0]
            ref = reference.causal_logprobs(prompt, list(completion.token_ids))
            control_worst = max(control_worst, _worst(ref, completion))
        stock_kv_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        kv_token_bytes = _kv_bytes_per_token(llm)
    finally:
        close_llm(llm)

    if os.environ.get("VLLM_CPU_KVCACHE_SPACE") and not _on_gpu():
        # The pool and its load buffers are carved out of VLLM_CPU_KVCACHE_SPACE:
        # the paged KV cache shrinks by their size and the total stays within
        # the budget.
        budget = int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * (1 << 30))
        chunk_kv = chunk_kv_blocks * block * kv_token_bytes
        stock_kv = stock_kv_blocks * block * kv_token_bytes
        print(f"KV budget {budget >> 20} MiB: stock paged KV {stock_kv >> 20} MiB; with "
              f"the chunk cache paged KV {chunk_kv >> 20} MiB + pool {pool_bytes >> 20} MiB "
              f"+ load buffers {scratch_bytes >> 20} MiB ({scratch_allocated >> 20} MiB used)")
        assert 0 < scratch_allocated <= scratch_bytes
        assert pool_bytes > 0 and chunk_kv + pool_bytes + scratch_bytes <= budget
        assert abs((stock_kv - chunk_kv) - pool_bytes - scratch_bytes) <= (
            2 * block * kv_token_bytes + (1 << 20))

    print(f"dtype={dtype} eager={EAGER} backend={os.environ.get('CHUNK_HALF_BACKEND', 'default')} "
          f"kv={os.environ.get('CHUNK_HALF_KV_DTYPE', 'auto')}: chunk cache worst |dlogprob| {chunk_worst:.4g}, "
          f"stock vLLM (control) {control_worst:.4g}, ratio "
          f"{chunk_worst / max(control_worst, 1e-12):.2f}")
    assert control_worst > 0.0
    assert chunk_worst <= FACTOR * control_worst, (
        f"{dtype}: chunk cache worst |logprob diff| {chunk_worst:.4g} > {FACTOR}x the "
        f"stock-vLLM control {control_worst:.4g}")
