#!/usr/bin/env python3
"""Where an all-hit request's host time goes, per prompt size (issue 40, deliverable 4).

The workload and engine of benchmarks/bench_host.py (tiny-llama's shapes and tokenizer,
random weights: compute negligible; documents of ~500 tokens, every request = system + all
documents shuffled anew + a new question, every document resident; the segment token cache
on, as a deployment that sees its documents again), then one all-hit request per size under
cProfile: wall ms, the floor (the question alone), and the functions with the most own time
and the most cumulative time. The engine core runs in-process, so scheduler, connector,
model runner and renderer are all in the profile.

    .cache/venv/bin/python benchmarks/profile_host.py [--docs 16 64] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
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
    llm = host_workload_llm(args.model, max_len)
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
        for _ in range(args.reps):
            t = time.perf_counter()
            out = llm.generate([prompt()], one, use_tqdm=False)[0]
            wall.append(time.perf_counter() - t)
            t = time.perf_counter()
            llm.generate(["question: " + words(rng, 12)], one, use_tqdm=False)
            floor.append(time.perf_counter() - t)
        print(f"\n== {num_docs} documents, {len(out.prompt_token_ids)} prompt tokens, "
              f"{out.num_cached_tokens} cached: all-hit {1e3 * statistics.median(wall):.1f} ms, "
              f"floor {1e3 * statistics.median(floor):.1f} ms (medians of {args.reps})",
              flush=True)
        p = prompt()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        llm.generate([p], one, use_tqdm=False)
        prof.disable()
        print(f"profiled request: {1e3 * (time.perf_counter() - t):.1f} ms under cProfile")
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
            lines = s.getvalue().splitlines()
            start = next(i for i, line in enumerate(lines) if "ncalls" in line)
            print(f"-- by {key}")
            print("\n".join(lines[start:start + args.top + 1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
