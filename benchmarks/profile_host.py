#!/usr/bin/env python3
"""Where an all-hit request's host time goes, per prompt size (issue 40, deliverable 4).

The workload and engine of benchmarks/bench_host.py (tiny-llama's shapes and tokenizer,
random weights: compute negligible; documents of ~500 tokens, every request = system + all
documents shuffled anew + a new question, every document resident; the segment token cache
on, as a deployment that sees its documents again), then one all-hit request per size under
cProfile: wall ms, the floor (the question alone), and the functions with the most own time
and the most cumulative time. The engine core runs in-process, so scheduler, connector,
model runner and renderer are all in the profile.

Then the split (issue 52, third pass): `--split-reps` all-hit and floor requests, each
profiled on its own, interleaved, and the median ms per request of disjoint parts (the
attention op, the chunk load and its ops, the rest of the model step, the scheduler, block
hashing, the rest) for both, with the all-hit minus floor difference: where every
millisecond above the floor goes. A single profiled request is one sample: an outlier
there (a garbage collection charged to whatever function allocated) is not a cost. The
collector's pauses during the timed requests are counted (gc.callbacks).

    OMP_NUM_THREADS=1 .cache/venv/bin/python benchmarks/profile_host.py [--docs 16 64] \
        [--top 25] [--split-reps 7] [--block-size 32] [--ab] [--save PREFIX]

`--ab` (issue 60): all-hit requests with the host-work cuts undone (`_BEFORE`) beside the
all-hit ones, in the same engine, interleaved, with a host-work total and its parts.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

from common import document, host_workload_llm, words

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--reps", type=int, default=5, help="timed requests before the profile")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--model", default=str(ROOT / ".cache/models/tiny-llama"))
    ap.add_argument("--split-reps", type=int, default=7,
                    help="all-hit and floor requests profiled one by one for the split")
    ap.add_argument("--apc", action="store_true",
                    help="add APC-same to the split: the same documents in one fixed order, "
                         "unsplit, a new question (vLLM's prefix cache at its best)")
    ap.add_argument("--ab", action="store_true",
                    help="add 'all-hit, before' to the split: the same all-hit requests with "
                         "issue 60's host-work cuts put back (_BEFORE), interleaved in the "
                         "same engine, with unprofiled medians of all three")
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM's KV block size (default: the platform's, 128 on the CPU; "
                         "32 is CPU_ATTN's smallest)")
    ap.add_argument("--save", default=None,
                    help="write the single profiled request to SAVE.<docs>.pstats")
    args = ap.parse_args()

    # NOTE: the documents first, with the model's own tokenizer, so that the engine's
    # max_model_len fits the longest prompt: `document` stops at the first length of at
    # least DOC_TOKENS, so 256 documents overshoot 256 * DOC_TOKENS (issue 52: `--docs 256`
    # was refused with max_model_len = 256 * DOC_TOKENS + 1024).
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    rng = random.Random(0)
    docs_of = {n: [document(rng, tok) for _ in range(n)] for n in args.docs}
    longest = max(sum(len(tok.encode(d, add_special_tokens=False)) for d in docs)
                  for docs in docs_of.values())
    # Margin: the system prompt, the question (12 words), and a few tokens a document
    # may gain when tokenized as its own segment.
    max_len = longest + 4 * max(args.docs) + 1024
    # NOTE: in-process engine core: the splitter lives in this process's renderer.
    llm = host_workload_llm(args.model, max_len, args.block_size)
    from vllm import SamplingParams
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for num_docs in args.docs:
        docs = docs_of[num_docs]

        def prompt() -> str:
            order = rng.sample(range(num_docs), num_docs)
            return " ## ".join(["answer from the documents", *[docs[i] for i in order],
                                "question: " + words(rng, 12)])

        for _ in range(2):  # every document resident, the token cache filled
            llm.generate([prompt()], one, use_tqdm=False)
        wall, floor = [], []
        pauses = _GcPauses()
        for _ in range(args.reps):
            t = time.perf_counter()
            out = llm.generate([prompt()], one, use_tqdm=False)[0]
            wall.append(time.perf_counter() - t)
            t = time.perf_counter()
            llm.generate(["question: " + words(rng, 12)], one, use_tqdm=False)
            floor.append(time.perf_counter() - t)
        pauses.stop()
        print(f"\n== {num_docs} documents, {len(out.prompt_token_ids)} prompt tokens, "
              f"{out.num_cached_tokens} cached: all-hit {1e3 * statistics.median(wall):.1f} ms, "
              f"floor {1e3 * statistics.median(floor):.1f} ms (medians of {args.reps}; all-hit "
              f"{1e3 * min(wall):.1f}-{1e3 * max(wall):.1f})",
              flush=True)
        print(f"garbage collections during those {2 * args.reps} requests: {pauses}")
        p = prompt()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        llm.generate([p], one, use_tqdm=False)
        prof.disable()
        print(f"profiled request: {1e3 * (time.perf_counter() - t):.1f} ms under cProfile")
        if args.save:
            prof.dump_stats(f"{args.save}.{num_docs}.pstats")
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
            lines = s.getvalue().splitlines()
            start = next(i for i, line in enumerate(lines) if "ncalls" in line)
            print(f"-- by {key}")
            print("\n".join(lines[start:start + args.top + 1]), flush=True)
        if args.split_reps:
            def same() -> str:
                return " ## ".join(["answer from the documents", *docs,
                                    "question: " + words(rng, 12)])

            _print_split(llm, prompt, lambda: "question: " + words(rng, 12), one,
                         args.split_reps, same if args.apc else None, args.ab)
    return 0


class _GcPauses:
    """The cyclic collector's pauses from now until `stop`, per generation."""

    def __init__(self) -> None:
        self.ms: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._t = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.ms[info["generation"]].append(1e3 * (time.perf_counter() - self._t))

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def __str__(self) -> str:
        return "; ".join(f"gen {g}: {len(v)}, {sum(v):.1f} ms (max {max(v, default=0):.1f})"
                         for g, v in self.ms.items())


# Disjoint parts of one request, from its profile: (label, how, what). "own": the summed
# own time of built-in functions whose name contains the text; "from": the same, only
# where called from a file (suffix); "cum": the cumulative time of a function (file
# suffix, name). Parts indented are inside the chunk load.
_PARTS = (
    ("attention op (cpu_attention_with_kv_cache)", "own", "cpu_attention_with_kv_cache"),
    ("chunk load (worker start_load_kv)", "cum", ("chunk_cache/worker.py", "start_load_kv")),
    ("  write op (cpu_attn_reshape_and_cache)", "cum", ("chunk_cache/cache_writers.py",
                                                       "_write_cpu")),
    ("  gathers (index_select)", "from", ("torch.index_select", "position_remapper.py")),
    ("  casts (copy_)", "from", ("method 'copy_'", "position_remapper.py")),
    ("  RoPE op (rotary_embedding)", "cum", ("worker/position_remapper.py",
                                          "rotate_in_place_indexed")),
    ("  rows expansion (LoadRows.expand)", "cum", ("chunk_cache/metadata.py", "expand")),
    ("rest of the model step", "cum", ("worker/gpu_model_runner.py", "execute_model")),
    ("scheduler (schedule)", "cum", ("core/sched/scheduler.py", "schedule")),
    ("block hashing (request_block_hasher)", "cum",
     ("core/kv_cache_utils.py", "request_block_hasher")),
    ("front end: split", "cum", ("renderers/chunk_split.py", "split")),
)


# Inside the host-work rows above (issue 60): vLLM's per-block and per-token work, and the
# chunk cache's own. Printed apart, not subtracted from anything; cumulative times.
_DETAILS = (
    ("  scheduler: vLLM allocate_slots (allocate, evict, cache blocks)",
     ("core/kv_cache_manager.py", "allocate_slots")),
    ("  scheduler: chunk admission + plan (get_num_new_matched_tokens)",
     ("chunk_cache/connector.py", "get_num_new_matched_tokens")),
    ("  scheduler: chunk connector metadata (build_connector_meta)",
     ("chunk_cache/scheduler_adapter.py", "build_connector_meta")),
    ("  hashing: chunk block keys (block_extra_keys)",
     ("core/chunk_block_keys.py", ("block_extra_keys", "_plain_block_keys"))),
    ("  model step: InputBatch.add_request (token ids copied)",
     ("worker/gpu_input_batch.py", "add_request")),
    ("  else: vLLM free_blocks (request finished)", ("core/block_pool.py", "free_blocks")),
    ("  else: vLLM validate_token_ids (min/max of the ids)",
     ("renderers/base.py", "validate_token_ids")),
    ("  else: chunk front-end check (validate_chunked_request)",
     ("renderers/chunk_split.py", "validate_chunked_request")),
    ("  else: chunk on_new_request (ChunkedPrompt, plan)",
     ("chunk_cache/scheduler_adapter.py", "on_new_request")),
)
# The "host work": everything outside the attention op and the chunk load.
_HOST = ("rest of the model step", "scheduler (schedule)",
         "block hashing (request_block_hasher)", "front end: split",
         "everything else (render, tokenize, output, Python)")
_HOST_LABEL = "HOST WORK (the five rows above the load's: sum)"

# Issue 60's cuts, put back for the "before" rows of `--ab`: (module, attribute, the
# module's own attribute holding the code before). NOTE: patch 0002 imports
# block_extra_keys by name into kv_cache_utils, so that name is the one swapped.
_BEFORE = (
    ("vllm.v1.core.kv_cache_utils", "block_extra_keys",
     ("vllm.v1.core.chunk_block_keys", "_plain_block_keys")),
)


class _Before:
    """Issue 60's cuts undone while inside (the code before them)."""

    def __enter__(self):
        import importlib
        self.saved = []
        for module, attr, (src, src_attr) in _BEFORE:
            m = importlib.import_module(module)
            self.saved.append((m, attr, getattr(m, attr)))
            setattr(m, attr, getattr(importlib.import_module(src), src_attr))
        return self

    def __exit__(self, *exc):
        for m, attr, value in self.saved:
            setattr(m, attr, value)


def _parts(prof: cProfile.Profile, wall_ms: float) -> dict[str, float]:
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    ms: dict[str, float] = {}
    for label, how, what in _PARTS:
        if how == "own":
            ms[label] = sum(1e3 * v[2] for (f, _, n), v in stats.items()
                            if f == "~" and what in n)
        elif how == "from":
            text, caller = what
            ms[label] = sum(1e3 * c[2] for (f, _, n), v in stats.items()
                            if f == "~" and text in n
                            for (cf, _, _), c in v[4].items() if cf.endswith(caller))
        else:
            suffix, name = what
            ms[label] = sum(1e3 * v[3] for (f, _, n), v in stats.items()
                            if n == name and f.endswith(suffix))
    # The model step contains the load and the attention op.
    load = ms["chunk load (worker start_load_kv)"]
    inside = [k for k in ms if k.startswith("  ")]
    ms["  rest of the load (Python, dispatch)"] = max(0.0, load - sum(ms[k] for k in inside))
    model = ms["rest of the model step"]
    ms["rest of the model step"] = max(0.0, model - load - ms[_PARTS[0][0]])
    counted = sum(v for k, v in ms.items() if not k.startswith("  "))
    ms["everything else (render, tokenize, output, Python)"] = max(0.0, wall_ms - counted)
    ms["whole request (wall, under cProfile)"] = wall_ms
    ms[_HOST_LABEL] = sum(ms[k] for k in _HOST)
    for label, (suffix, name) in _DETAILS:
        names = name if isinstance(name, tuple) else (name,)
        ms[label] = sum(1e3 * v[3] for (f, _, n), v in stats.items()
                        if n in names and f.endswith(suffix))
    # Printed in this order: the load's own rest right after its ops.
    order = [label for label, _, _ in _PARTS]
    order.insert(order.index("rest of the model step"), "  rest of the load (Python, dispatch)")
    return {k: ms[k] for k in order + [k for k in ms if k not in order]}


def _print_split(llm, prompt, question, params, reps: int, same=None, ab: bool = False) -> None:
    """Median parts of `reps` all-hit and floor requests (and APC-same ones with
    `same`, and all-hit ones with issue 60's cuts undone with `ab`), each profiled alone,
    interleaved; with `ab` also each run once unprofiled per rep."""
    # NOTE: APC-same goes unsplit (as bench_long_context.py's row): vLLM's prefix cache
    # alone; twice first so that its blocks are cached.
    unsplit = {"split_chunks": False}
    names = ["all-hit"] + (["all-hit, before"] if ab else []) + ["floor"]
    if same is not None:
        names.append("APC-same")
        for _ in range(2):
            llm.generate([same()], params, use_tqdm=False, tokenization_kwargs=unsplit)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    walls: dict[str, list[float]] = {name: [] for name in names}
    make = {"all-hit": prompt, "all-hit, before": prompt, "floor": question, "APC-same": same}

    def one(name: str, profiled: bool) -> None:
        p = make[name]()
        kwargs = unsplit if name == "APC-same" else None
        with _Before() if name == "all-hit, before" else _Nothing():
            prof = cProfile.Profile() if profiled else None
            t = time.perf_counter()
            if prof is not None:
                prof.enable()
            llm.generate([p], params, use_tqdm=False, tokenization_kwargs=kwargs)
            if prof is not None:
                prof.disable()
            ms = 1e3 * (time.perf_counter() - t)
        if prof is not None:
            runs[name].append(_parts(prof, ms))
        else:
            walls[name].append(ms)

    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            if ab:
                one(name, profiled=False)
            one(name, profiled=True)
    print(f"-- split, medians of {reps} requests each profiled alone (ms)")
    cols = names[:]
    head = f"{'part':<66}" + "".join(f" {c:>15}" for c in cols) + f" {'above':>8}"
    print(head)
    for label in runs["all-hit"][0]:
        med = {name: statistics.median(r[label] for r in runs[name]) for name in names}
        line = f"{label:<66}" + "".join(f" {med[c]:>15.2f}" for c in cols)
        line += f" {med['all-hit'] - med['floor']:>8.2f}"
        print(line, flush=True)
    if ab:
        med = {n: statistics.median(walls[n]) for n in names}
        print("-- unprofiled, medians of " + str(reps) + " interleaved (ms): "
              + ", ".join(f"{n} {med[n]:.2f}" for n in names), flush=True)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


if __name__ == "__main__":
    sys.exit(main())
