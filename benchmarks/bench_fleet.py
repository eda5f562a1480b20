# SPDX-License-Identifier: Apache-2.0
"""A fleet of two replicas on one Mooncake Store, side by side in one run (issue 31).

    ./fork bench --fleet [--requests 5] [--doc-words 395]

One master and one standalone client on loopback (tests/store_fleet.py), then
three servers, one after another (one fits in memory at a time):

* replica A (`--enable-chunk-cache --chunk-store ...`) computes the documents of
  every request (k = 8 documents each, never seen before) and writes them to
  the store; it exits;
* replica B (same flags) answers, per request: the same documents in a new
  order with a new question (**store hit**: every document read from the
  store), then once more (**pool hit**: its own pool), then k = 8 documents
  nobody has seen (**miss**: computed by children);
* `stock` (no prefix caching, no chunk cache) answers the store-hit prompts.

Reported: TTFT medians and their ratios; store get bytes/s (from replica B's
`vllm:chunk_cache_store_get_*` counters) against a host memcpy of the same size
on this machine. Targets (issue 31): store hit <= 2x pool hit, >= 10x below stock.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

from common import CONFIGS, TARGET_DOC_WORDS, Server, make_corpus, parse_args, write_results

K = 8


def _prompts(system: str, docs: list[list[str]], tag: str) -> list[str]:
    rng = random.Random(f"store-{tag}")
    out = []
    for i, group in enumerate(docs):
        group = list(group)
        rng.shuffle(group)
        out.append(" ## ".join([system, *group, f"Question {tag}-{i}: which document is first?"]))
    return out


def _median_ttft(server: Server, prompts: list[str], max_tokens: int) -> float:
    return statistics.median(server.complete(p, max_tokens)[0] for p in prompts)


def _memcpy_bytes_per_s(nbytes: int) -> float:
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def run(args, out: Path) -> str:
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from tests.store_fleet import MooncakeFleet

    requests = args.requests
    words = args.doc_words if args.doc_words != 80 else TARGET_DOC_WORDS
    corpus = make_corpus(K * (2 * requests + 1), words, args.seed, "store")
    groups = [corpus[K * i:K * (i + 1)] for i in range(2 * requests + 1)]
    shared, fresh = groups[:requests], groups[requests:2 * requests]
    warm = groups[-1]
    system = args.system
    chunk = CONFIGS["chunk"]
    rows: dict[str, float] = {}
    with MooncakeFleet(out / "mooncake", segment_bytes=2 << 30, timeout_s=5.0) as fleet:
        store_flags = [*chunk, "--chunk-store", fleet.spec_text]
        print("[bench] replica A computes the shared documents ...", flush=True)
        a = Server(args.model, store_flags, out / "server-replica-a.log")
        try:
            for p in _prompts(system, shared, "a"):
                a.complete(p, 1)
            # The writes run in the background: give them a few steps and seconds.
            for _ in range(3):
                a.complete(system + " ## drain ## hello", 1)
                time.sleep(1)
            puts = a.metrics().get("vllm:chunk_cache_store_puts", 0.0)
        finally:
            a.stop()
        print(f"[bench] replica A wrote {puts:.0f} entries; replica B ...", flush=True)
        b = Server(args.model, store_flags, out / "server-replica-b.log")
        try:
            b.complete(" ## ".join([system, *warm, "warm-up"]), 1)
            before = b.metrics()
            rows["store hit"] = _median_ttft(b, _prompts(system, shared, "b1"), args.max_tokens)
            after = b.metrics()
            rows["pool hit"] = _median_ttft(b, _prompts(system, shared, "b2"), args.max_tokens)
            rows["miss"] = _median_ttft(b, _prompts(system, fresh, "b3"), args.max_tokens)
        finally:
            b.stop()
    print("[bench] stock ...", flush=True)
    s = Server(args.model, CONFIGS["stock"], out / "server-stock.log")
    try:
        s.complete(" ## ".join([system, *warm, "warm-up"]), 1)
        rows["stock"] = _median_ttft(s, _prompts(system, shared, "b1"), args.max_tokens)
    finally:
        s.stop()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    hits = delta("vllm:chunk_cache_store_hits")
    children = delta("vllm:chunk_cache_child_computes")
    got, secs = delta("vllm:chunk_cache_store_get_bytes"), delta(
        "vllm:chunk_cache_store_get_seconds")
    gets = delta("vllm:chunk_cache_store_gets")
    read_bps = got / secs if secs else 0.0
    copy_bps = _memcpy_bytes_per_s(int(got / gets) if gets else 1 << 20)
    lines = [f"k = {K} documents of {words} words, {requests} requests per row, "
             f"TTFT median over them (max_tokens={args.max_tokens}).", "",
             "| replica B | TTFT (s) | vs pool hit | stock / this |", "|---|---|---|---|"]
    for name, ttft in rows.items():
        lines.append(f"| {name} | {ttft:.3f} | {ttft / rows['pool hit']:.2f}x | "
                     f"{rows['stock'] / ttft:.1f}x |")
    lines += ["",
              f"Store-hit requests: {hits:.0f} segments read from the store, {children:.0f} "
              "child computes.",
              f"Store reads: {got / 1e6:.1f} MB in {gets:.0f} entries, "
              f"{read_bps / 1e9:.2f} GB/s (the workers' batch_get_into calls, "
              "verification excluded) vs a host memcpy of one entry's size "
              f"{copy_bps / 1e9:.2f} GB/s ({100 * read_bps / copy_bps:.0f}%).",
              "",
              "Targets: store hit <= 2x pool hit: "
              f"{'met' if rows['store hit'] <= 2 * rows['pool hit'] else 'NOT met'} "
              f"({rows['store hit'] / rows['pool hit']:.2f}x); >= 10x below stock: "
              f"{'met' if rows['stock'] >= 10 * rows['store hit'] else 'NOT met'} "
              f"({rows['stock'] / rows['store hit']:.1f}x)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    if args.requests == 16:  # the sweeps' default: 5 per row keeps the run ~10 min
        args.requests = 5
    out = Path(args.out or f"benchmarks/results/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    table = run(args, out)
    params = {"fleet": True, "requests": args.requests, "model": args.model}
    return write_results(out, "Chunk store benchmark", params, table)


if __name__ == "__main__":
    sys.exit(main())
