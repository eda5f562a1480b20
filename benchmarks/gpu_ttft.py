"""TTFT on a GPU: stock vLLM vs vLLM prefix caching vs the chunk cache (and the floor:
the question alone on the chunk-cache engine), on a model with Llama-3-8B's shapes and
random weights (load_format="dummy": no download; timing does not need trained weights).

    python benchmarks/gpu_ttft.py make MODEL_DIR TOKENIZER_DIR
    python benchmarks/gpu_ttft.py MODE MODEL_DIR     # MODE: stock | prefix | apc | chunk

Workload, per prompt size S in TTFT_SIZES (default 2048,8192,32768 tokens): documents of
~DOC_TOKENS (500) tokens, S / DOC_TOKENS of them per request: system ## documents (all of
the size's pool, shuffled anew per request) ## question. Warm-up: two requests (every
document is seen; the chunk cache and the prefix cache fill); then TTFT_REPS (10) measured
requests, one at a time, each with a new question and a new order. TTFT = wall time of a
generate() with max_tokens=1. Default compilation (FULL_AND_PIECEWISE CUDA graphs) unless
TTFT_EAGER=1. TTFT_DRY_RUN=1: print the plan (sizes, reps, engine arguments) and exit.
APC-same (mode `apc`, issue 60): vLLM's prefix cache at its best, the honest peer of the
chunk cache's all-hit request: the prefix-caching engine, every request the same documents
in the same order (one fixed shuffle per size) and a new question.

Decode (TTFT_DECODE=1, default): 64 requests of ~512 prompt tokens decode 256 tokens each
(ignore_eos); tokens/s = 64 * 255 / (t(256 tokens) - t(1 token)): run on `prefix` (flag
off) and `chunk` (flag on) to compare.
Boundary recompute (TTFT_RECOMPUTE_K=K, chunk mode): the engine gets
`chunk_recompute_tokens=K`; every measured request is sent as `sink` (the manager's
recompute set to 0) and as `sink+K`, one after the other: two rows per size, modes
`chunk` and `chunk+K<K>`, the same floor.
TTFT_CUDAGRAPH=MODE sets the engine's cudagraph_mode (e.g. PIECEWISE: with
CHUNK_CACHE_RECOMPUTE_ONE_STEP=1 the boundary recompute in one step on CUDA, which
refuses full graphs).
Profile (TTFT_PROFILE=1, chunk mode): a torch profiler table of one all-hit request at the
middle size. Every mode runs the engine core in-process.
One JSON line per measurement on stdout.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from common import DOC_TOKENS, document, words

SIZES = [int(s) for s in os.environ.get("TTFT_SIZES", "2048,8192,32768").split(",")]
REPS = int(os.environ.get("TTFT_REPS", "10"))

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def make_model_dir(out: Path, tokenizer_from: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(LLAMA3_8B))
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())


def recompute_k(mode: str) -> int:
    """TTFT_RECOMPUTE_K (chunk mode only): the engine is built with
    `chunk_recompute_tokens=K` and each measured request is run twice, as `sink`
    (recompute 0) and as `sink+K`, one after the other."""
    k = int(os.environ.get("TTFT_RECOMPUTE_K", "0"))
    if k < 0 or (k and mode != "chunk"):
        raise SystemExit(f"TTFT_RECOMPUTE_K={k}: a K > 0 needs mode chunk (got {mode})")
    return k


def engine_kwargs(mode: str, model: str, sizes: list[int], eager: bool, k: int = 0) -> dict:
    if mode not in ("stock", "prefix", "apc", "chunk"):
        raise SystemExit(f"unknown mode {mode!r}: stock | prefix | apc | chunk")
    kwargs = dict(model=model, load_format="dummy", dtype="bfloat16",
                  max_model_len=max(sizes) + 1024, gpu_memory_utilization=0.85, seed=0,
                  enforce_eager=eager, max_num_seqs=64)
    if os.environ.get("TTFT_CUDAGRAPH"):  # e.g. PIECEWISE (the one-step recompute's mode)
        kwargs["compilation_config"] = {"cudagraph_mode": os.environ["TTFT_CUDAGRAPH"]}
    if mode == "stock":
        kwargs["enable_prefix_caching"] = False
    elif mode in ("prefix", "apc"):
        kwargs["enable_prefix_caching"] = True
    else:
        kwargs.update(enable_chunk_cache=True, enable_prefix_caching=True)
        if k:
            kwargs["chunk_recompute_tokens"] = k
    return kwargs


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    mode, model = sys.argv[1], sys.argv[2]
    profile = mode == "chunk" and os.environ.get("TTFT_PROFILE") == "1"
    # NOTE: in-process engine core for every mode (the profiler needs it): no mode pays an
    # IPC hop the others do not.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    eager = os.environ.get("TTFT_EAGER", "0") == "1"
    k = recompute_k(mode)
    kwargs = engine_kwargs(mode, model, SIZES, eager, k)
    if os.environ.get("TTFT_DRY_RUN") == "1":  # the plan only (checked on the CPU)
        emit(dry_run=True, mode=mode, sizes=SIZES, reps=REPS, engine=kwargs)
        return
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**kwargs)
    emit(mode=mode, start_up_s=round(time.time() - t0, 1), enforce_eager=eager,
         **({"recompute_k": k} if k else {}))
    manager = None
    if k:
        # NOTE: `sink` and `sink+K` on one engine, request by request (as
        # bench_recompute.py --paired): the manager's recompute set to 0 is `sink`
        # (cached entries do not depend on K).
        manager = llm.llm_engine.engine_core.engine_core.scheduler.connector \
            .chunk_scheduler.manager
    tok = llm.get_tokenizer()
    rng = random.Random(0)
    sep = " ## " if mode == "chunk" else " "  # stock/prefix: the same text, no markers
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def doc() -> str:
        return document(rng, tok)

    def timed(prompt: str):
        t = time.perf_counter()
        out = llm.generate([prompt], one, use_tqdm=False)[0]
        return time.perf_counter() - t, out

    for size in SIZES:
        docs = [doc() for _ in range(max(1, (size - 64) // DOC_TOKENS))]
        same = rng.sample(range(len(docs)), len(docs))  # apc: one order for every request

        def prompt(question: str) -> str:
            order = same if mode == "apc" else rng.sample(range(len(docs)), len(docs))
            return sep.join(["answer from the documents", *[docs[i] for i in order],
                             "question: " + question])

        for _ in range(2):
            timed(prompt(words(rng, 12)))
        ks = (0, k) if k else (0,)
        ttfts = {x: [] for x in ks}
        cached = {x: [] for x in ks}
        lengths, floor = [], []
        for _ in range(REPS):
            for x in ks:
                if manager is not None:
                    manager.recompute_tokens = x
                t, out = timed(prompt(words(rng, 12)))
                ttfts[x].append(t)
                cached[x].append(out.num_cached_tokens or 0)
                lengths.append(len(out.prompt_token_ids))
            if mode == "chunk":  # the floor: the question alone, same engine
                floor.append(timed("question: " + words(rng, 12))[0])
        if manager is not None:
            manager.recompute_tokens = k
        for x in ks:
            row = dict(mode=mode if not x else f"{mode}+K{x}", size=size, docs=len(docs),
                       prompt_tokens_mean=round(statistics.mean(lengths)),
                       cached_tokens_mean=round(statistics.mean(cached[x])),
                       ttft_ms_median=round(1e3 * statistics.median(ttfts[x]), 2),
                       ttft_ms_min=round(1e3 * min(ttfts[x]), 2),
                       ttft_ms_max=round(1e3 * max(ttfts[x]), 2))
            if floor:
                row["floor_ms_median"] = round(1e3 * statistics.median(floor), 2)
            if k:
                row["engine_recompute_k"] = k
            emit(**row)
        if profile and size == SIZES[len(SIZES) // 2]:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            p = prompt(words(rng, 12))
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                timed(p)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25),
                  flush=True)

    if os.environ.get("TTFT_DECODE", "1") == "1" and mode != "stock":
        batch = [sep.join(["answer from the documents", doc(), "question: " + words(rng, 12)])
                 for _ in range(64)]
        llm.generate(batch, one, use_tqdm=False)  # prefill (and fill the caches)
        times = {}
        for n in (1, 256):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            t = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            times[n] = time.perf_counter() - t
        emit(mode=mode, decode_batch=64, decode_tokens_per_s=round(
            64 * 255 / (times[256] - times[1]), 1))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "make":
        make_model_dir(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
