# SPDX-License-Identifier: Apache-2.0
"""RAG serving benchmark: stock vLLM vs vLLM prefix caching vs the chunk cache.

    ./fork bench [--quick] [--requests N] [--docs 2,4,8] [--reuse 0,0.5,0.9] ...

Starts three servers, one after another, on 127.0.0.1 (the same fork, so the only
difference is the flags): `stock` (no prefix caching, no chunk cache), `prefix`
(vLLM's prefix caching, its default) and `chunk` (--enable-chunk-cache, prefix
caching on too). Each gets the same deterministic request stream through the
OpenAI completions API with streaming: every request draws k documents in a
random order (a share `reuse` of them from a small hot set) and asks a question.
Per configuration: TTFT median/p90, requests/s, output tokens/s, hit rate; the
ratios between configurations come from this one run. The `floor` is the question
alone as a prompt, on the chunk-cache server: what a hit can at best approach.
Writes results.md, params.json and PNG plots into the results directory.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from common import (CONFIGS, Point, Result, Server, Workload, machine, make_prompts,
                    parse_args, ratio, run_point)


# -------------------------------------------------------------------- report


def write_table(results: list[Result], floor: dict[Point, float]) -> str:
    lines = ["| k | reuse | conc | config | TTFT median ms | TTFT p90 ms | req/s | out tok/s "
             "| hit rate | TTFT vs chunk |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    by_point: dict[Point, dict[str, Result]] = {}
    for r in results:
        by_point.setdefault(r.point, {})[r.config] = r
    for point, rows in by_point.items():
        chunk = rows.get("chunk")
        for name, r in rows.items():
            hr = "-" if r.hit_rate is None else f"{r.hit_rate:.0%}"
            vs = ratio(r.ttft_median, chunk.ttft_median) if chunk else "-"
            lines.append(f"| {point.k} | {point.reuse:g} | {point.concurrency} | {name} | "
                         f"{r.ttft_median * 1e3:.0f} | {r.ttft_p90 * 1e3:.0f} | "
                         f"{r.requests_per_s:.2f} | {r.tokens_per_s:.1f} | {hr} | {vs} |")
        if point in floor and chunk:
            lines.append(f"| {point.k} | {point.reuse:g} | {point.concurrency} | floor "
                         f"(question alone) | {floor[point] * 1e3:.0f} | | | | | chunk = "
                         f"{ratio(chunk.ttft_median, floor[point])} of floor |")
    return "\n".join(lines) + "\n"


def write_ratios(results: list[Result], floor: dict[Point, float]) -> str:
    """The three configurations against each other, per point, from this one run."""
    lines = ["| k | reuse | conc | TTFT stock/chunk | TTFT prefix/chunk | TTFT stock/prefix "
             "| req/s chunk/stock | req/s chunk/prefix | TTFT chunk/floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    by_point: dict[Point, dict[str, Result]] = {}
    for r in results:
        by_point.setdefault(r.point, {})[r.config] = r
    for point, rows in by_point.items():
        if not {"stock", "prefix", "chunk"} <= rows.keys():
            continue
        st, pf, ch = rows["stock"], rows["prefix"], rows["chunk"]
        fl = ratio(ch.ttft_median, floor[point]) if point in floor else "-"
        lines.append(f"| {point.k} | {point.reuse:g} | {point.concurrency} | "
                     f"{ratio(st.ttft_median, ch.ttft_median)} | "
                     f"{ratio(pf.ttft_median, ch.ttft_median)} | "
                     f"{ratio(st.ttft_median, pf.ttft_median)} | "
                     f"{ratio(ch.requests_per_s, st.requests_per_s)} | "
                     f"{ratio(ch.requests_per_s, pf.requests_per_s)} | {fl} |")
    return "\n".join(lines) + "\n"


def plot(results: list[Result], out: Path, base: Point) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no plots (the table has every number)")
        return []
    written = []
    sweeps = [("k", "documents per request", "ttft_vs_docs.png", "TTFT median (ms)"),
              ("reuse", "reuse rate", "ttft_vs_reuse.png", "TTFT median (ms)"),
              ("concurrency", "concurrency", "throughput_vs_concurrency.png", "requests/s")]
    for attr, label, name, ylabel in sweeps:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for config in CONFIGS:
            pts = sorted((getattr(r.point, attr), r) for r in results if r.config == config
                         and all(getattr(r.point, a) == getattr(base, a)
                                 for a in ("k", "reuse", "concurrency") if a != attr))
            if len(pts) < 1:
                continue
            ys = [(r.requests_per_s if attr == "concurrency" else r.ttft_median * 1e3)
                  for _, r in pts]
            ax.plot([x for x, _ in pts], ys, marker="o", label=config)
        ax.set_xlabel(label)
        ax.set_ylabel(ylabel)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(name)
    return written


# ---------------------------------------------------------------------- main


def points(args) -> tuple[list[Point], Point]:
    ks = [int(x) for x in args.docs.split(",")]
    reuses = [float(x) for x in args.reuse.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    base = Point(ks[len(ks) // 2], reuses[len(reuses) // 2], concs[0])
    # One-factor sweeps around the base point (not the full grid).
    pts = {base}
    pts |= {Point(k, base.reuse, base.concurrency) for k in ks}
    pts |= {Point(base.k, r, base.concurrency) for r in reuses}
    pts |= {Point(base.k, base.reuse, c) for c in concs}
    return sorted(pts, key=lambda p: (p.k, p.reuse, p.concurrency)), base


def main(argv=None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    for flag, script in (("targets", "bench_targets.py"), ("fleet", "bench_fleet.py"),
                         ("recompute", "bench_recompute.py")):
        if getattr(args, flag):
            # `./fork bench --{flag}` runs that script; this one only runs the sweeps.
            sys.exit(f"--{flag}: run benchmarks/{script} (`./fork bench --{flag}` does)")
    from tqdm import tqdm

    work = Workload(args.doc_words, args.requests, args.max_tokens, args.system, args.seed)
    pts, base = points(args)
    out = Path(args.out or f"benchmarks/results/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    prompts = {p: make_prompts(work, p, f"k{p.k}-r{p.reuse}-c{p.concurrency}") for p in pts}
    results: list[Result] = []
    floor: dict[Point, float] = {}
    for config, flags in CONFIGS.items():
        print(f"[bench] starting the {config} server ({' '.join(flags)}) ...", flush=True)
        server = Server(args.model, flags, out / f"server-{config}.log")
        try:
            server.complete(work.system + " ## warm-up document ## hello", 2)
            with tqdm(total=len(pts) * work.requests, desc=config, unit="req") as bar:
                for p in pts:
                    results.append(run_point(server, config, work, p, prompts[p], bar))
            if config == "chunk":
                for p in tqdm(pts, desc="floor", unit="point"):
                    floor[p] = statistics.median(
                        server.complete(q, work.max_tokens)[0] for _, q in prompts[p])
        finally:
            server.stop()
    table = write_table(results, floor)
    # NOTE: the floor is timed one request at a time, also for points with concurrency > 1.
    table += "\nRatios (same run; floor timed one request at a time):\n\n"
    table += write_ratios(results, floor)
    params = {"workload": asdict(work), "points": [asdict(p) for p in pts],
              "base_point": asdict(base), "configs": CONFIGS, "model": args.model,
              "machine": machine()}
    (out / "params.json").write_text(json.dumps(params, indent=1))
    pngs = plot(results, out, base)
    (out / "results.md").write_text(
        f"# RAG benchmark ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
        f"Machine: {params['machine']}\n\nWorkload: {asdict(work)}\n\n" + table
        + "".join(f"\n![{n}]({n})\n" for n in pngs))
    print(table)
    print(f"[bench] wrote {out}/results.md, params.json" + (", " + ", ".join(pngs) if pngs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
