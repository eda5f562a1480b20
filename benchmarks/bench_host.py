#!/usr/bin/env python3
"""Host work of an all-hit request: the segment token cache on and off, side by side.

On a GPU an all-hit request's device work is small (the load and the question); what
separates it from the floor is host work, and a large part of that is tokenizing every
document again (docs/benchmarks.md, "Host work of an all-hit request"). This runs the
workload of benchmarks/gpu_ttft.py (documents of ~500 tokens, every request = system +
all documents shuffled anew + a new question, all hit) on the CPU with a model whose
compute is negligible: tiny-llama's shapes (4 layers, hidden 128) and its tokenizer,
the tokenizer of the GPU sweep too, random weights. In one in-process engine, requests
alternate between the token cache on (filled by the previous request, as in a deployment
that sees its documents again) and off (emptied and unable to keep anything), and the
medians of each are printed with their ratio, and the floor (the question alone, same
engine). Wall and process time per request.

    .cache/venv/bin/python benchmarks/bench_host.py [--docs 16 64] [--reps 10]

Needs `./fork setup` (tiny-llama in .cache/models).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from common import DOC_TOKENS, document, host_workload_llm, words

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--model", default=str(ROOT / ".cache/models/tiny-llama"))
    args = ap.parse_args()

    # NOTE: in-process engine core: the splitter lives in this process's renderer.
    llm = host_workload_llm(args.model, max(args.docs) * DOC_TOKENS + 1024)
    from vllm import SamplingParams
    from vllm.renderers.segment_token_cache import DEFAULT_MAX_TOKENS, SegmentTokenCache
    splitter = llm.renderer._chunk_splitter
    tok = llm.get_tokenizer()
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0.0)

    print(f"{'documents':>9} {'prompt tokens':>13} | {'cache off ms':>12} {'cache on ms':>11} "
          f"{'off / on':>8} | {'cpu off ms':>10} {'cpu on ms':>9} | {'floor ms':>8} "
          f"{'off / floor':>11} {'on / floor':>10}")
    for num_docs in args.docs:
        docs = [document(rng, tok) for _ in range(num_docs)]

        def prompt() -> str:
            order = rng.sample(range(num_docs), num_docs)
            return " ## ".join(["answer from the documents", *[docs[i] for i in order],
                                "question: " + words(rng, 12)])

        for _ in range(2):  # every document resident in the chunk cache
            llm.generate([prompt()], one, use_tqdm=False)
        wall: dict[str, list[float]] = {"off": [], "on": [], "floor": []}
        cpu: dict[str, list[float]] = {"off": [], "on": [], "floor": []}
        tokens = 0
        for rep in range(args.reps):
            for mode in ("on", "off", "floor") if rep % 2 == 0 else ("off", "on", "floor"):
                splitter.token_cache = SegmentTokenCache(
                    DEFAULT_MAX_TOKENS if mode == "on" else 0)
                if mode == "on":
                    llm.generate([prompt()], one, use_tqdm=False)  # keeps the documents
                p = prompt() if mode != "floor" else "question: " + words(rng, 12)
                t, c = time.perf_counter(), time.process_time()
                out = llm.generate([p], one, use_tqdm=False)[0]
                wall[mode].append(time.perf_counter() - t)
                cpu[mode].append(time.process_time() - c)
                if mode != "floor":
                    tokens = len(out.prompt_token_ids)
        off, on, floor = (1e3 * statistics.median(wall[m]) for m in ("off", "on", "floor"))
        cpu_off, cpu_on = (1e3 * statistics.median(cpu[m]) for m in ("off", "on"))
        print(f"{num_docs:>9} {tokens:>13} | {off:>12.1f} {on:>11.1f} {off / on:>7.2f}x | "
              f"{cpu_off:>10.1f} {cpu_on:>9.1f} | {floor:>8.1f} {off / floor:>10.2f}x "
              f"{on / floor:>9.2f}x", flush=True)
    splitter.token_cache = SegmentTokenCache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
