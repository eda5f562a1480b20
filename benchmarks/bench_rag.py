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

import argparse
import json
import os
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

CONFIGS: dict[str, list[str]] = {
    "stock": ["--no-enable-prefix-caching"],
    "prefix": ["--enable-prefix-caching"],
    "chunk": ["--enable-chunk-cache"],
}
SERVE_ARGS = ["--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager",
              "--max-model-len", "8192", "--served-model-name", "model", "--seed", "0"]
_WORDS = ("river stone market valley engine harbor garden signal copper orbit lantern "
          "meadow canyon archive beacon forest island summit glacier circuit compass "
          "quarry delta prairie ridge tunnel vessel mirror anchor thunder").split()


@dataclass(frozen=True)
class Point:
    """One measured setting of the workload."""

    # Documents per request.
    k: int
    # Share of documents drawn from the hot set (reused across requests).
    reuse: float
    # Requests in flight at once.
    concurrency: int


@dataclass(frozen=True)
class Workload:
    # Words per generated document.
    doc_words: int
    # Requests per point and configuration.
    requests: int
    # Generated tokens per request.
    max_tokens: int
    # The system prompt (segment 0).
    system: str
    # Seed of the corpus and of the draws.
    seed: int


@dataclass
class Result:
    """Per configuration and point: one row of the table."""

    config: str
    point: Point
    ttft: list[float] = field(default_factory=list)
    output_tokens: int = 0
    wall: float = 0.0
    hit_rate: float | None = None

    @property
    def ttft_median(self) -> float:
        return statistics.median(self.ttft)

    @property
    def ttft_p90(self) -> float:
        return percentile(self.ttft, 0.9)

    @property
    def requests_per_s(self) -> float:
        return len(self.ttft) / self.wall

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default)."""
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def make_corpus(n: int, words: int, seed: int, tag: str) -> list[str]:
    """Deterministic documents; `tag` keeps corpora of different points apart."""
    rng = random.Random(f"{seed}-{tag}")
    docs = []
    for i in range(n):
        body = " ".join(rng.choice(_WORDS) for _ in range(words))
        docs.append(f"Document {tag}-{i}: {body}.")
    return docs


def make_prompts(work: Workload, point: Point, tag: str) -> list[tuple[str, str]]:
    """(chunked prompt, question) per request, deterministic."""
    rng = random.Random(f"{work.seed}-{tag}-draw")
    hot = make_corpus(2 * point.k, work.doc_words, work.seed, f"{tag}-hot")
    cold = make_corpus(point.k * work.requests, work.doc_words, work.seed, f"{tag}-cold")
    out = []
    for i in range(work.requests):
        docs = []
        for _ in range(point.k):
            pool = hot if rng.random() < point.reuse else cold
            choice = rng.choice(pool)
            while choice in docs:
                choice = rng.choice(pool)
            docs.append(choice)
        rng.shuffle(docs)
        question = f"Question {i}: which document mentions {rng.choice(_WORDS)} first?"
        out.append((" ## ".join([work.system, *docs, question]), question))
    return out


# --------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, flags: list[str], log: Path,
                 env: dict[str, str] | None = None):
        self.port = free_port()
        vllm = str(Path(sys.executable).with_name("vllm"))
        self.log = open(log, "w")
        self.proc = subprocess.Popen([vllm, "serve", model, *SERVE_ARGS, "--port",
                                      str(self.port), *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.url = f"http://127.0.0.1:{self.port}"
        started = time.monotonic()
        next_note = started + 15
        while time.monotonic() < started + 900:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited; see {log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    print(f"[bench] server up after {time.monotonic() - started:.0f} s",
                          flush=True)
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(2)
            # Start-up takes about a minute on 2 cores: say that it is still going.
            if time.monotonic() >= next_note:
                print(f"[bench]   still starting ({time.monotonic() - started:.0f} s; "
                      f"log: {log})", flush=True)
                next_note += 15
        self.stop()
        raise TimeoutError(f"vllm serve did not start; see {log}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def complete(self, prompt: str, max_tokens: int) -> tuple[float, int]:
        """(TTFT in s, output tokens) of one streamed completion."""
        body = json.dumps({"model": "model", "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        ttft, tokens = None, 0
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if ttft is None and event.get("choices"):
                    ttft = time.perf_counter() - start
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        assert ttft is not None, "no token streamed"
        return ttft, tokens

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for m in re.finditer(r"^(vllm:[a-z_]+?)(?:_total)?\{[^}]*\} ([0-9.e+-]+)$", text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out


def hit_rate(config: str, before: dict, after: dict) -> float | None:
    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    if config == "chunk":
        hits = delta("vllm:chunk_cache_hits") + delta("vllm:chunk_cache_in_flight_joins")
        lookups = hits + delta("vllm:chunk_cache_misses")
    else:
        hits, lookups = delta("vllm:prefix_cache_hits"), delta("vllm:prefix_cache_queries")
    return hits / lookups if lookups else None


def run_point(server: Server, config: str, work: Workload, point: Point,
              prompts: list[tuple[str, str]], progress) -> Result:
    before = server.metrics()
    result = Result(config, point)
    start = time.perf_counter()
    with ThreadPoolExecutor(point.concurrency) as pool:
        for ttft, tokens in pool.map(lambda p: server.complete(p[0], work.max_tokens), prompts):
            result.ttft.append(ttft)
            result.output_tokens += tokens
            progress.update(1)
    result.wall = time.perf_counter() - start
    result.hit_rate = hit_rate(config, before, server.metrics())
    return result


# -------------------------------------------------------------------- report


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


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


def machine() -> dict:
    import torch
    import vllm

    cpu = platform.processor()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "torch": torch.__version__, "vllm": vllm.__version__}


# ---------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(os.environ.get("FORK_MODELS", ".cache/models"),
                                                    "SmolLM2-135M-Instruct"))
    p.add_argument("--quick", action="store_true", help="tiny sizes: a few minutes")
    p.add_argument("--docs", default="2,4,8", help="k values (documents per request)")
    p.add_argument("--reuse", default="0,0.5,0.9", help="reuse rates")
    p.add_argument("--concurrency", default="1,4", help="concurrency values")
    p.add_argument("--requests", type=int, default=16, help="requests per point and config")
    p.add_argument("--doc-words", type=int, default=80, help="words per document")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--system", default="Answer the question from the documents.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results directory")
    p.add_argument("--fleet", action="store_true",
                   help="a fleet of two replicas on one Mooncake Store (bench_fleet.py): "
                        "store hit vs pool hit vs miss vs stock at k = 8")
    p.add_argument("--targets", action="store_true",
                   help="measure the performance targets instead of the sweeps "
                        "(~400-token documents; see benchmarks/bench_targets.py)")
    p.add_argument("--recompute", action="store_true",
                   help="all-hit TTFT of --chunk-recompute-tokens 12 (one step and one "
                        "step per head) against sink and stock (benchmarks/bench_recompute.py)")
    p.add_argument("--paired", action="store_true",
                   help="--recompute: one in-process engine, configurations interleaved "
                        "request by request (robust to a shared machine's load; no stock)")
    p.add_argument("--load-requests", type=int, default=16,
                   help="--targets: requests of the concurrency-8 load workload")
    args = p.parse_args(argv)
    if args.quick:
        args.docs, args.reuse, args.concurrency = "2,4", "0,0.9", "1,4"
        args.requests, args.doc_words = 6, 50
    return args


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
    from tqdm import tqdm

    args = parse_args(argv)
    work = Workload(args.doc_words, args.requests, args.max_tokens, args.system, args.seed)
    pts, base = points(args)
    out = Path(args.out or f"benchmarks/results/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.targets:
        return run_targets(args, out)
    if args.fleet:
        return run_fleet(args, out)
    if args.recompute:
        return run_recompute(args, out)
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


def run_recompute(args, out: Path) -> int:
    import bench_recompute

    if args.requests == 16:  # the sweeps' default: 5 timed requests per cell
        args.requests = 5
    if args.paired:
        table = bench_recompute.paired_table(bench_recompute.run_paired(args, args.requests))
    else:
        table = bench_recompute.run(args, out)
    params = {"recompute": True, "paired": args.paired, "requests": args.requests, "max_tokens": args.max_tokens,
              "configs": bench_recompute.CONFIGS, "model": args.model}
    return _write_results(out, "Boundary recompute all-hit TTFT", params, table)


def run_targets(args, out: Path) -> int:
    import bench_targets

    if args.requests == 16:  # the sweeps' default: 5 per target keeps the run ~15 min
        args.requests = 5
    table = bench_targets.run(args, out)
    params = {"targets": True, "requests": args.requests, "load_requests": args.load_requests,
              "doc_words": bench_targets.TARGET_DOC_WORDS, "max_tokens": args.max_tokens,
              "configs": CONFIGS, "model": args.model}
    return _write_results(out, "RAG benchmark targets", params, table)


def _write_results(out: Path, title: str, params: dict, table: str) -> int:
    params["machine"] = machine()
    (out / "params.json").write_text(json.dumps(params, indent=1))
    (out / "results.md").write_text(
        f"# {title} ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
        f"Machine: {params['machine']}\n\n" + table)
    print(table)
    print(f"[bench] wrote {out}/results.md, params.json")
    return 0


def run_fleet(args, out: Path) -> int:
    import bench_fleet

    if args.requests == 16:  # the sweeps' default: 5 per row keeps the run ~10 min
        args.requests = 5
    table = bench_fleet.run(args, out)
    params = {"fleet": True, "requests": args.requests, "model": args.model}
    return _write_results(out, "Chunk store benchmark", params, table)


if __name__ == "__main__":
    sys.exit(main())
