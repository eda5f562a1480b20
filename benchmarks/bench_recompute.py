# SPDX-License-Identifier: Apache-2.0
"""All-hit TTFT of the boundary recompute, side by side in one run (issue 33).

    ./fork bench --recompute [--requests 5]

The targets' all-hit workload (common.hit_runs: k = 4 and 8 documents of ~400 tokens, the same
documents in a new order and with a new question on every request, one warm-up
request first), sent to one server after another:

* `stock`: vLLM without prefix caching;
* `sink`: the chunk cache, no recompute;
* `sink+K12 steps`: `--chunk-recompute-tokens 12` with one engine step per chunk
  head (the path before issue 33; CHUNK_CACHE_RECOMPUTE_ONE_STEP=0);
* `sink+K12`: `--chunk-recompute-tokens 12` with every head and the question in one
  step (query runs, where supported: the CPU backend).

Median TTFT per configuration and k, and each against `sink`.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from common import (TARGET_DOC_WORDS, Point, Result, Server, Workload, hit_runs, make_corpus,
                    parse_args, run_target, write_results)

K = 12
CONFIGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "stock": (["--no-enable-prefix-caching"], {}),
    "sink": (["--enable-chunk-cache"], {}),
    f"sink+K{K} steps": (["--enable-chunk-cache", "--chunk-recompute-tokens", str(K)],
                         {"CHUNK_CACHE_RECOMPUTE_ONE_STEP": "0"}),
    f"sink+K{K}": (["--enable-chunk-cache", "--chunk-recompute-tokens", str(K)], {}),
}
DOCS = (4, 8)


def run(args, out) -> str:
    from tqdm import tqdm

    work = Workload(TARGET_DOC_WORDS, args.requests, args.max_tokens, args.system, args.seed)
    runs = [hit_runs(work, k, args.requests) for k in DOCS]
    results: dict[tuple[str, int], Result] = {}
    for config, (flags, env) in CONFIGS.items():
        print(f"[bench] starting the {config} server ({' '.join(flags)} {env or ''}) ...",
              flush=True)
        server = Server(args.model, flags, out / f"server-{config.replace(' ', '-')}.log",
                        env=env)
        try:
            server.complete(work.system + " ## warm-up document ## hello", 2)
            with tqdm(total=sum(len(r.timed) for r in runs), desc=config, unit="req") as bar:
                for k, r in zip(DOCS, runs):
                    results[(config, k)] = run_target(server, "chunk" if "sink" in config
                                                      else config, work, r, bar)
        finally:
            server.stop()
    return table(results)


def table(results: dict[tuple[str, int], Result]) -> str:
    lines = ["| configuration | " + " | ".join(
        f"all-hit TTFT {k} docs, median ms | vs `sink`" for k in DOCS) + " |",
        "|---|" + "---|---|" * len(DOCS)]
    for config in CONFIGS:
        cells = []
        for k in DOCS:
            ttft = results[(config, k)].ttft_median
            sink = results[("sink", k)].ttft_median
            cells += [f"{ttft * 1000:.1f}", f"{ttft / sink:.2f}x"]
        lines.append(f"| `{config}` | " + " | ".join(cells) + " |")
    spread = {k: statistics.quantiles(results[("sink", k)].ttft, n=4)
              if len(results[("sink", k)].ttft) > 1 else [] for k in DOCS}
    lines.append("")
    lines.append("Timed requests per cell: "
                 f"{len(next(iter(results.values())).ttft)}; `sink` quartiles (ms): "
                 + "; ".join(f"{k} docs {[round(q * 1000, 1) for q in v]}"
                             for k, v in spread.items()))
    return "\n".join(lines) + "\n"


__all__ = ["run", "table", "Point"]


def run_paired(args, rounds: int) -> dict[int, dict[str, list[float]]]:
    """The same comparison in one in-process engine (SmolLM2, K = 12), the
    configurations interleaved request by request, so that a shared machine's
    load drifts over all of them alike: `sink` (the manager's recompute set to
    0 for that request: cached entries do not depend on K), `sink+K12 steps`
    (the connector switched to one head per step) and `sink+K12`. TTFT is the
    wall time of `LLMEngine.step()` calls up to the request's first token.
    No stock column: stock needs its own engine (the server run has it)."""
    import random
    import time

    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.recompute_step import (
        RecomputeSteps,
    )

    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=8192,
              seed=0, enable_chunk_cache=True, chunk_recompute_tokens=K)
    engine = llm.llm_engine
    adapter = engine.engine_core.engine_core.scheduler.connector.chunk_scheduler
    one_step = adapter._steps
    modes = {"sink": (0, one_step), f"sink+K{K} steps": (K, RecomputeSteps(False, "bench")),
             f"sink+K{K}": (K, one_step)}
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    by_k: dict[int, dict[str, list[float]]] = {}
    n = 0
    for k in DOCS:
        docs = make_corpus(k, TARGET_DOC_WORDS, args.seed, f"target-hit-{k}")
        llm.generate([" ## ".join([args.system, *docs, "Warm-up."])], params, use_tqdm=False)
        rng = random.Random(f"{args.seed}-paired-{k}")
        times: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(rounds * len(modes)):
            mode = list(modes)[i % len(modes)]
            adapter.manager.recompute_tokens, adapter._steps = modes[mode]
            n += 1
            prompt = " ## ".join([args.system, *rng.sample(docs, k), f"Question {n}: which?"])
            engine.add_request(str(n), llm._preprocess_cmpl([prompt])[0], params)
            start = time.perf_counter()
            while not any(o.request_id == str(n) and o.outputs[0].token_ids
                          for o in engine.step()):
                pass
            times[mode].append(time.perf_counter() - start)
            while engine.has_unfinished_requests():
                engine.step()
        by_k[k] = times
    adapter.manager.recompute_tokens, adapter._steps = K, one_step
    return by_k


def paired_table(by_k: dict[int, dict[str, list[float]]]) -> str:
    lines = ["| configuration | " + " | ".join(
        f"all-hit TTFT {k} docs, median ms | vs `sink` (median of paired ratios)"
        for k in by_k) + " |", "|---|" + "---|---|" * len(by_k)]
    for mode in next(iter(by_k.values())):
        cells = []
        for times in by_k.values():
            ratios = [a / b for a, b in zip(times[mode], times["sink"])]
            cells += [f"{statistics.median(times[mode]) * 1000:.1f}",
                      f"{statistics.median(ratios):.2f}x"]
        lines.append(f"| `{mode}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    if args.requests == 16:  # the sweeps' default: 5 timed requests per cell
        args.requests = 5
    out = Path(args.out or f"benchmarks/results/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.paired:
        text = paired_table(run_paired(args, args.requests))
    else:
        text = run(args, out)
    params = {"recompute": True, "paired": args.paired, "requests": args.requests,
              "max_tokens": args.max_tokens, "configs": CONFIGS, "model": args.model}
    return write_results(out, "Boundary recompute all-hit TTFT", params, text)


if __name__ == "__main__":
    sys.exit(main())
