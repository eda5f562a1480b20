# SPDX-License-Identifier: Apache-2.0
"""The performance targets of the chunk cache, measured side by side in one run.

    ./fork bench --targets [--requests 5] [--load-requests 16]

Each target is a workload of its own (documents of ~400 tokens, as the targets
are stated), sent to the same three servers as the sweeps (`stock`, `prefix`,
`chunk`), one server after another:

* all-hit (k = 4 and 8): the same k documents in a new random order and with a
  new question on every request, after one warm-up request (for every server:
  prefix caching gets its chance too);
* all-miss: k = 8 documents never seen before on every request (for the chunk
  cache: children, capture, load and the question, all in the first request);
* load: concurrency 8, 80% of the documents from a hot set (the sweeps' draw);
* the floor: the question alone as a prompt, on the chunk-cache server;
* the remap: the remap micro-benchmark (common.bench_remap, also bench_core's) at SmolLM2-135M's shapes, bytes/s
  against a plain copy of the same bytes.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import (CONFIGS, TARGET_DOC_WORDS, Point, Result, Server, TargetRuns, Workload,
                    bench_remap, hit_runs, make_corpus, make_prompts, parse_args, run_target,
                    write_results)

def miss_runs(work: Workload, k: int, requests: int) -> TargetRuns:
    timed = []
    for i in range(requests):
        docs = make_corpus(k, work.doc_words, work.seed, f"target-miss-{k}-{i}")
        question = f"Question {i}: which document is about a harbor?"
        timed.append((" ## ".join([work.system, *docs, question]), question))
    # Warm the system prompt and the engine, not the documents.
    warmup = [" ## ".join([work.system, "A warm-up document.", "Hello?"])]
    return TargetRuns(f"miss-{k}", warmup, timed, 1)


def load_runs(work: Workload, k: int, requests: int) -> TargetRuns:
    load = Workload(work.doc_words, requests, work.max_tokens, work.system, work.seed)
    prompts = make_prompts(load, Point(k, 0.8, 8), f"target-load-{k}")
    return TargetRuns(f"load-{k}", [], prompts, 8)


def all_runs(work: Workload, requests: int, load_requests: int) -> list[TargetRuns]:
    return [hit_runs(work, 4, requests), hit_runs(work, 8, requests),
            miss_runs(work, 8, requests), load_runs(work, 8, load_requests)]


@dataclass(frozen=True)
class Verdict:
    target: str
    measured: str
    met: bool


def verdicts(results: dict[tuple[str, str], Result], floor: dict[str, float],
             remap_share: float | None) -> list[Verdict]:
    """Every target of the issue, met or not, from the measured figures."""
    def ttft(config: str, name: str) -> float:
        return results[(config, name)].ttft_median

    out = []
    for base in ("stock", "prefix"):
        r = ttft(base, "hit-8") / ttft("chunk", "hit-8")
        out.append(Verdict(f"all-hit, 8 docs: TTFT >= 25x lower than {base}",
                           f"{r:.1f}x ({ttft(base, 'hit-8') * 1e3:.0f} ms vs "
                           f"{ttft('chunk', 'hit-8') * 1e3:.0f} ms)", r >= 25))
    for k in (4, 8):
        r = ttft("chunk", f"hit-{k}") / floor[f"hit-{k}"]
        out.append(Verdict(f"all-hit, {k} docs: TTFT <= 2x the floor",
                           f"{r:.2f}x ({ttft('chunk', f'hit-{k}') * 1e3:.0f} ms vs floor "
                           f"{floor[f'hit-{k}'] * 1e3:.0f} ms)", r <= 2))
    r = ttft("chunk", "miss-8") / ttft("stock", "miss-8")
    out.append(Verdict("all-miss first request, 8 docs: TTFT <= stock",
                       f"{r:.2f}x of stock ({ttft('chunk', 'miss-8') * 1e3:.0f} ms vs "
                       f"{ttft('stock', 'miss-8') * 1e3:.0f} ms)", r <= 1))
    load_chunk, load_stock = results[("chunk", "load-8")], results[("stock", "load-8")]
    r = load_chunk.requests_per_s / load_stock.requests_per_s
    out.append(Verdict("load (concurrency 8, 80% reuse, 8 docs): req/s >= 5x stock",
                       f"{r:.2f}x ({load_chunk.requests_per_s:.3f} vs "
                       f"{load_stock.requests_per_s:.3f} req/s)", r >= 5))
    if remap_share is not None:
        out.append(Verdict("remap >= 50% of plain-copy throughput",
                           f"{remap_share:.0%}", remap_share >= 0.5))
    return out


def table(results: dict[tuple[str, str], Result], floor: dict[str, float],
          found: list[Verdict]) -> str:
    lines = ["| workload | config | TTFT median ms | TTFT p90 ms | req/s | hit rate |",
             "|---|---|---|---|---|---|"]
    for (config, name), r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        hr = "-" if r.hit_rate is None else f"{r.hit_rate:.0%}"
        lines.append(f"| {name} | {config} | {r.ttft_median * 1e3:.0f} | "
                     f"{r.ttft_p90 * 1e3:.0f} | {r.requests_per_s:.3f} | {hr} |")
    for name, seconds in floor.items():
        lines.append(f"| {name} | floor (question alone) | {seconds * 1e3:.0f} | | | |")
    lines += ["", "| target | measured (same run) | met |", "|---|---|---|"]
    lines += [f"| {v.target} | {v.measured} | {'yes' if v.met else 'NO'} |" for v in found]
    return "\n".join(lines) + "\n"


def remap_share() -> float:
    """bench_core's remap at SmolLM2-135M's shapes (3 KV heads x 64, float32,
    3,200 rows: 8 documents of 400 tokens): share of plain-copy throughput."""
    import torch

    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        timing = bench_remap("cpu", torch.float32, heads=3, head_size=64, rows=3200)
    return timing.plain_copy / timing.remap


def run(args, out) -> str:
    from tqdm import tqdm

    work = Workload(TARGET_DOC_WORDS, args.requests, args.max_tokens, args.system, args.seed)
    runs = all_runs(work, args.requests, args.load_requests)
    results: dict[tuple[str, str], Result] = {}
    floor: dict[str, float] = {}
    for config, flags in CONFIGS.items():
        print(f"[bench] starting the {config} server ({' '.join(flags)}) ...", flush=True)
        server = Server(args.model, flags, out / f"server-{config}.log")
        try:
            server.complete(work.system + " ## warm-up document ## hello", 2)
            total = sum(len(r.timed) for r in runs)
            with tqdm(total=total, desc=config, unit="req") as bar:
                for r in runs:
                    results[(config, r.name)] = run_target(server, config, work, r, bar)
            if config == "chunk":
                for r in runs:
                    if r.name.startswith("hit"):
                        floor[r.name] = statistics.median(
                            server.complete(q, work.max_tokens)[0] for _, q in r.timed)
        finally:
            server.stop()
    found = verdicts(results, floor, remap_share())
    return table(results, floor, found)


def main(argv=None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    if args.requests == 16:  # the sweeps' default: 5 per target keeps the run ~15 min
        args.requests = 5
    out = Path(args.out or f"benchmarks/results/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    table = run(args, out)
    params = {"targets": True, "requests": args.requests, "load_requests": args.load_requests,
              "doc_words": TARGET_DOC_WORDS, "max_tokens": args.max_tokens,
              "configs": CONFIGS, "model": args.model}
    return write_results(out, "RAG benchmark targets", params, table)


if __name__ == "__main__":
    sys.exit(main())
