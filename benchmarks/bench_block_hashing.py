#!/usr/bin/env python3
"""vLLM's block hashing of one prompt, stock against chunked (issue 52, item 2).

vLLM hashes every full block of a prompt when the request is made (the chain its prefix
cache looks up and stores by). A chunked prompt's blocks also carry their segment
boundaries as extra keys (vllm/v1/core/chunk_block_keys.py, from patch 0002), which is
what lets a follow-up request over the same system prompt and leading documents share
them (docs/design/ownership.md). Rows, timed interleaved on one thread, medians:

- stock: the prompt without a layout (vLLM's own cost, the same for APC);
- chunked: the prompt with its layout, as served.

    .cache/venv/bin/python benchmarks/bench_block_hashing.py [--tokens 8000 32000 128000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8000, 32000, 128000])
    ap.add_argument("--doc-tokens", type=int, default=500)
    ap.add_argument("--block", type=int, default=128, help="vLLM's CPU block size")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()

    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default --prefix-caching-hash-algo
    init_none_hash(hash_fn)
    rng = random.Random(0)
    print(f"sha256, block {args.block}, documents of {args.doc_tokens} tokens; ms a prompt")
    print(f"{'tokens':>7} | {'stock':>7} {'chunked':>8} | {'chunked/stock':>13}")
    for n in args.tokens:
        tokens = [rng.randrange(49152) for _ in range(n)]
        layout = [20] + [args.doc_tokens] * ((n - 40) // args.doc_tokens)
        layout.append(n - sum(layout))
        rows = {"stock": None, "chunked": layout}
        times: dict[str, list[float]] = {name: [] for name in rows}
        for rep in range(args.reps + 1):  # the first: warm-up, not timed
            for name, lay in rows.items():
                hasher = get_request_block_hasher(args.block, hash_fn)
                request = Request("r", tokens, SamplingParams(max_tokens=1), None,
                                  arrival_time=0.0, chunk_layout=lay)
                t = time.perf_counter()
                hasher(request)
                if rep:
                    times[name].append(time.perf_counter() - t)
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        print(f"{n:>7} | {ms['stock']:>7.2f} {ms['chunked']:>8.2f} | "
              f"{ms['chunked'] / ms['stock']:>13.2f}")


if __name__ == "__main__":
    main()
