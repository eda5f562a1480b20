# SPDX-License-Identifier: Apache-2.0
"""The manager alone on the all-hit path (issue 52): one request of a
system prompt, N resident documents and a question arrives, is decided
(admission: every segment's key and verification, the prefill plan, the
load plan) and released. No engine, no model.

`--base REV` times the same request with the manager's modules as they are
at REV (chunk_hash_index.py, chunk_block_pool.py, chunk_cache_manager.py,
read with `git show`), interleaved with the working tree's, in one process:
rounds alternate A and B, medians over rounds.

    OMP_NUM_THREADS=1 nice .cache/venv/bin/python benchmarks/bench_admission.py \
        --docs 64 256 --base HEAD
"""

import argparse
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Dependency order: each module is executed after those it imports.
MODULES = ("chunk_hash_index", "chunk_block_pool", "chunk_cache_manager")


def _load_set(sources: dict[str, str], tag: str) -> dict:
    """Execute these sources as the vllm.v1.core modules of their names,
    each seeing the others of the set; sys.modules is restored after."""
    saved = {m: sys.modules.get(f"vllm.v1.core.{m}") for m in MODULES}
    loaded = {}
    try:
        for m in MODULES:
            name = f"vllm.v1.core.{m}"
            spec = importlib.util.spec_from_loader(name, loader=None)
            mod = importlib.util.module_from_spec(spec)
            mod.__file__ = f"<{tag}>/{m}.py"
            sys.modules[name] = mod
            exec(compile(sources[m], mod.__file__, "exec"), mod.__dict__)
            loaded[m] = mod
    finally:
        for m, old in saved.items():
            if old is None:
                sys.modules.pop(f"vllm.v1.core.{m}", None)
            else:
                sys.modules[f"vllm.v1.core.{m}"] = old
    return loaded


def _sources(rev: str | None) -> dict[str, str]:
    out = {}
    for m in MODULES:
        path = f"vllm/v1/core/{m}.py"
        if rev is None:
            with open(os.path.join(REPO, path)) as f:
                out[m] = f.read()
        else:
            out[m] = subprocess.check_output(["git", "-C", REPO, "show", f"{rev}:{path}"],
                                             text=True)
    return out


def _setup(mods: dict, docs: int, doc_tokens: int, seed: int):
    from vllm.v1.core.chunk_structures import ChunkContextMode, ChunkedPrompt, SegmentSpan

    mgr_mod = mods["chunk_cache_manager"]
    ns = mods["chunk_hash_index"].ChunkNamespace(model="m", kv_dtype="bfloat16", tokenizer="t")
    rng = random.Random(seed)
    bos = 1
    system = [bos] + [rng.randrange(2, 128_000) for _ in range(40)]
    documents = [[rng.randrange(2, 128_000) for _ in range(doc_tokens)] for _ in range(docs)]

    def prompt(order, question):
        segments = [system, *order, question]
        spans, start = [], 0
        for seg in segments:
            spans.append(SegmentSpan(start, start + len(seg)))
            start += len(seg)
        return ChunkedPrompt([t for seg in segments for t in seg], tuple(spans))

    block = 16
    manager = mgr_mod.ChunkCacheManager(2 * docs * (doc_tokens // block + 2) + 64, block,
                                        ChunkContextMode.SINK, sink_token_id=bos)
    manager.add_request("warm", prompt(documents, [5, 6, 7]), ns)
    admission = manager.admit("warm")
    # NOTE: an admission carries its children since 94a8bb3; older revisions
    # (--base) hand them out through take_new_children.
    children = getattr(admission, "children", None)
    for child in children if children is not None else manager.take_new_children():
        manager.finish_child(child.request_id, stored=True)
    manager.puts_shipped()
    manager.release("warm")
    # Fresh lists, as a new request's prompt has (no ints shared with the
    # entries' stored ids beyond CPython's small-int cache).
    order = [list(int(str(t)) for t in d) for d in rng.sample(documents, docs)]
    the_prompt = prompt(order, [8, 9, 10])
    counter = iter(range(10**9))

    def request() -> float:
        rid = f"r{next(counter)}"
        t0 = time.perf_counter()
        manager.add_request(rid, the_prompt, ns)
        decision = manager.decide(rid)
        plan = decision.load_plan(0, decision.plan.num_tokens)
        t1 = time.perf_counter()
        assert decision.ready and len(plan.segments) == docs + 1
        manager.release(rid)
        return t1 - t0

    return request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[256])
    ap.add_argument("--doc-tokens", type=int, default=500)
    ap.add_argument("--base", default=None, help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--per-round", type=int, default=5)
    args = ap.parse_args()

    sets = {"tree": _load_set(_sources(None), "tree")}
    if args.base:
        sets[args.base] = _load_set(_sources(args.base), args.base)
    print(f"load average at start {os.getloadavg()}")
    for docs in args.docs:
        fns = {tag: _setup(mods, docs, args.doc_tokens, seed=docs) for tag, mods in sets.items()}
        for fn in fns.values():
            fn()
        times = {tag: [] for tag in fns}
        for r in range(args.rounds):
            tags = list(fns) if r % 2 == 0 else list(reversed(fns))
            for tag in tags:
                times[tag].extend(fns[tag]() for _ in range(args.per_round))
        for tag, ts in times.items():
            ts_ms = sorted(t * 1e3 for t in ts)
            print(f"docs {docs:4d} x {args.doc_tokens} tokens  {tag:>10}: median "
                  f"{statistics.median(ts_ms):7.3f} ms  (p10 {ts_ms[len(ts_ms) // 10]:.3f}, "
                  f"p90 {ts_ms[len(ts_ms) * 9 // 10]:.3f}, n={len(ts_ms)})")
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
