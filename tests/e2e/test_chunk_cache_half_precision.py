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
torch.compile + CUDA graphs) or 1 (--enforce-eager); docs/gpu.md. On a GPU each engine
runs in a process of its own (tests/e2e/half_precision_engine.py; CHUNK_HALF_ISOLATE=0/1
overrides): a second engine in one process died in vLLM's memory profiling there. Each
engine's rows, and the chunk cache's worst difference, are printed as soon as they
exist, before the control starts.

CHUNK_HALF_RECOMPUTE=K gives the chunk-cache engine --chunk-recompute-tokens K (the
reference recomputes the same heads); CHUNK_HALF_CUDAGRAPH=PIECEWISE (or another mode)
sets both engines' cudagraph_mode. With CHUNK_CACHE_RECOMPUTE_ONE_STEP=1 in the
environment this is the GPU check of the one-step recompute on CUDA (issue 40,
deliverable 3; tools/gpu/issue40.sh, item `k12-1step`).
"""

from __future__ import annotations

import os
import random

import pytest

from tests.conftest import models_dir
from tests.e2e.chunk_reference import Layout, Reference, random_text

pytestmark = pytest.mark.e2e

SMOL = str(models_dir() / "SmolLM2-135M-Instruct")
MODEL = os.environ.get("CHUNK_HALF_MODEL", SMOL)
DTYPES = os.environ.get("CHUNK_HALF_DTYPES", "bfloat16").split(",")
EAGER = os.environ.get("CHUNK_HALF_EAGER", "1") == "1"
NUM_GEN = 4
FACTOR = 3.0
RECOMPUTE = int(os.environ.get("CHUNK_HALF_RECOMPUTE", "0"))


def _engine_kwargs(dtype: str) -> dict:
    kwargs = dict(dtype=dtype, enforce_eager=EAGER)
    if os.environ.get("CHUNK_HALF_BACKEND"):  # e.g. TRITON_ATTN on a GPU
        kwargs["attention_backend"] = os.environ["CHUNK_HALF_BACKEND"]
    if os.environ.get("CHUNK_HALF_KV_DTYPE"):  # e.g. fp8 on a GPU (both engines)
        kwargs["kv_cache_dtype"] = os.environ["CHUNK_HALF_KV_DTYPE"]
    if os.environ.get("CHUNK_HALF_CUDAGRAPH"):  # e.g. PIECEWISE (both engines)
        kwargs["compilation_config"] = {
            "cudagraph_mode": os.environ["CHUNK_HALF_CUDAGRAPH"]
        }
    if os.environ.get("CHUNK_HALF_GPU_UTIL"):
        # The two engines one after the other on one GPU.
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
            out.append(
                Layout(
                    "answer from the documents",
                    chunks,
                    random_text(rng, rng.randint(3, 10)),
                )
            )
    return out


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# Each engine in a process of its own (tests/e2e/half_precision_engine.py): the default
# on a GPU, where vLLM's memory profiling of a second engine in one process fails (H100,
# 2026-11-26); CHUNK_HALF_ISOLATE=0/1 overrides. On the CPU both run in this process (CI
# time), and the slow tier runs the isolated form twice in one pytest process.
ISOLATE = os.environ.get("CHUNK_HALF_ISOLATE", "")


def _worst(ref, logprobs) -> float:
    """Worst |logprob diff| over each step's top tokens (`logprobs`: per step,
    token id (str) -> logprob, as half_precision_engine returns them)."""
    worst = 0.0
    for step, lps in enumerate(logprobs):
        for t, lp in lps.items():
            worst = max(worst, abs(lp - float(ref[step][int(t)])))
    return worst


@pytest.fixture(scope="module")
def reference():
    return Reference(MODEL)


def _label(dtype: str) -> str:
    return (
        f"dtype={dtype} eager={EAGER} "
        f"backend={os.environ.get('CHUNK_HALF_BACKEND', 'default')} "
        f"kv={os.environ.get('CHUNK_HALF_KV_DTYPE', 'auto')}"
        + (
            f" recompute={RECOMPUTE} one_step="
            f"{os.environ.get('CHUNK_CACHE_RECOMPUTE_ONE_STEP', 'unset')}"
            if RECOMPUTE
            else ""
        )
        + (
            f" cudagraph={os.environ['CHUNK_HALF_CUDAGRAPH']}"
            if os.environ.get("CHUNK_HALF_CUDAGRAPH")
            else ""
        )
    )


def _check(reference, dtype: str, isolate: bool, workdir) -> tuple[dict, dict]:
    from vllm.v1.core.chunk_prefill_plan import PrefillPlan

    from tests.e2e.half_precision_engine import run_engine, run_engine_in_subprocess

    def engine(request):
        if isolate:
            return run_engine_in_subprocess(request, workdir)
        if not EAGER and request["role"] == "stock":
            # A second engine in one process: vLLM's compile monitor forbids CUDA
            # graph capture after the first engine's capture ended.
            from vllm.compilation import monitor

            monitor.cudagraph_capturing_enabled = True
        return run_engine(request)

    layouts = _layouts(reference)
    prompts = [reference.chunked_prompt(layout) for layout in layouts]
    common = dict(model=MODEL, engine_kwargs=_engine_kwargs(dtype), num_gen=NUM_GEN)

    # Cold batch, then warm batch (loads from the pool at new positions).
    chunk = engine(
        dict(
            common,
            role="chunk",
            prompts=[layout.prompt for layout in layouts],
            batches=[[0, 1, 2], [3, 4, 5]],
            recompute=RECOMPUTE,
        )
    )
    chunk_worst, chunk_rows = 0.0, []
    for i, (prompt, out) in enumerate(zip(prompts, chunk["outputs"])):
        ref = reference.next_token_logprobs(
            prompt, "sink", out["token_ids"], recompute_tokens=RECOMPUTE
        )
        worst = _worst(ref, out["logprobs"])
        chunk_worst = max(chunk_worst, worst)
        chunk_rows.append((i, prompt, out))
        print(
            f"half-precision chunk cache prompt {i}: |dlogprob| {worst:.4g} "
            f"(cached {out['num_cached_tokens']} of {len(out['prompt_token_ids'])})",
            flush=True,
        )
    # NOTE: the chunk cache's figure is printed before the control starts (which may
    # fail).
    print(
        f"{_label(dtype)}: chunk cache worst |dlogprob| {chunk_worst:.4g} "
        "(control next)",
        flush=True,
    )
    for i, prompt, out in chunk_rows:
        assert out["prompt_token_ids"] == prompt.token_ids, i
        if RECOMPUTE:  # the recomputed heads are computed, the rest loaded
            loaded = PrefillPlan.for_prompt(prompt, RECOMPUTE).num_loaded
            assert loaded <= out["num_cached_tokens"] <= prompt.question_span.start, i
        else:
            assert out["num_cached_tokens"] == prompt.question_span.start, i

    stock = engine(
        dict(
            common,
            role="stock",
            prompts=[p.token_ids for p in prompts],
            batches=[list(range(len(prompts)))],
        )
    )
    control_worst = 0.0
    for prompt, out in zip(prompts, stock["outputs"]):
        ref = reference.causal_logprobs(prompt, out["token_ids"])
        control_worst = max(control_worst, _worst(ref, out["logprobs"]))
    print(
        f"{_label(dtype)}: chunk cache worst |dlogprob| {chunk_worst:.4g}, "
        f"stock vLLM (control) {control_worst:.4g}, ratio "
        f"{chunk_worst / max(control_worst, 1e-12):.2f}"
        f"{' (each engine in a process of its own)' if isolate else ''}",
        flush=True,
    )

    if os.environ.get("VLLM_CPU_KVCACHE_SPACE") and not _on_gpu():
        # The pool and its load buffers are carved out of VLLM_CPU_KVCACHE_SPACE:
        # the paged KV cache shrinks by their size and the total stays within
        # the budget.
        budget = int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * (1 << 30))
        block, kv_token_bytes = chunk["block_size"], stock["kv_token_bytes"]
        chunk_kv = chunk["kv_blocks"] * block * kv_token_bytes
        stock_kv = stock["kv_blocks"] * block * kv_token_bytes
        pool_bytes, scratch_bytes = chunk["pool_bytes"], chunk["scratch_bytes"]
        print(
            f"KV budget {budget >> 20} MiB: stock paged KV {stock_kv >> 20} MiB; with "
            f"the chunk cache paged KV {chunk_kv >> 20} MiB "
            f"+ pool {pool_bytes >> 20} MiB "
            f"+ load buffers {scratch_bytes >> 20} MiB "
            f"({chunk['scratch_allocated'] >> 20} MiB used)"
        )
        assert 0 < chunk["scratch_allocated"] <= scratch_bytes
        assert pool_bytes > 0 and chunk_kv + pool_bytes + scratch_bytes <= budget
        assert abs((stock_kv - chunk_kv) - pool_bytes - scratch_bytes) <= (
            2 * block * kv_token_bytes + (1 << 20)
        )

    assert control_worst > 0.0
    assert chunk_worst <= FACTOR * control_worst, (
        f"{dtype}: chunk cache worst |logprob diff| {chunk_worst:.4g} > {FACTOR}x the "
        f"stock-vLLM control {control_worst:.4g}"
    )
    return chunk, stock


# NOTE: in the slow tier: bf16 on the CPU took 190 s of CI on an AVX2 machine (the
# longest test; CI ran over its 45 minutes). Half precision is the GPU's matter
# (tools/gpu runs it in fp16 and bf16); the unit tier keeps the bf16 bytes of the pool
# round trip and the rotation.
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_half_precision_chunk_cache_within_3x_of_stock_vllm(reference, dtype, tmp_path):
    isolate = ISOLATE == "1" if ISOLATE else _on_gpu()
    _check(reference, dtype, isolate, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(
    3600
)  # four engines one after the other: ~25 minutes on 2 shared cores
def test_each_engine_in_a_process_of_its_own_twice_in_one_pytest_process(
    reference, tmp_path
):
    """The GPU form (issue 40): each engine in a fresh process, run twice from one
    pytest process, so that nothing of an engine (device memory, compile state, vLLM's
    globals) outlives its process; both runs give the same rows, from four distinct
    processes."""
    first = _check(reference, DTYPES[0], True, tmp_path / "first")
    second = _check(reference, DTYPES[0], True, tmp_path / "second")
    pids = {first[0]["pid"], first[1]["pid"], second[0]["pid"], second[1]["pid"]}
    assert len(pids) == 4 and os.getpid() not in pids
    for a, b in zip(first, second):
        assert [o["token_ids"] for o in a["outputs"]] == [
            o["token_ids"] for o in b["outputs"]
        ]
