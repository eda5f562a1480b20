# SPDX-License-Identifier: Apache-2.0
"""The pieces the benchmarks share: the servers' configurations, the workload and its
deterministic documents, a `vllm serve` process and its streamed completions, a result
row, the target workloads (all-hit documents, ~400 tokens each), the remap timing and the
GPU scripts' random documents.

Every benchmark script imports this module and none imports another benchmark
(tests/tools/test_benchmark_imports.py checks it): before, bench_rag dispatched to
bench_fleet, bench_recompute and bench_targets, which imported their pieces back from
bench_rag, a circle. Nothing here imports torch or vLLM at module level: the serving
benchmarks and their unit tests run without them.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

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


@dataclass
class ServeProcess:
    """One `vllm serve` on 127.0.0.1, from start to healthy to stopped: the one owner of the
    process for the benchmarks and the end-to-end tests (tests/e2e/server.py), which before
    each had a copy of this loop."""

    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @classmethod
    def start(cls, model: str, args: list[str], log_path: Path, timeout: float,
              env: dict[str, str] | None = None,
              waiting: Callable[[float], None] | None = None) -> "ServeProcess":
        """Start `vllm serve MODEL ARGS --port P` and return once /health answers 200;
        `waiting(seconds)` is called every ~15 s of the wait (start-up takes about a minute
        on 2 cores). An exit or the timeout raises with the log's tail."""
        port = free_port()
        vllm = str(Path(sys.executable).with_name("vllm"))
        with open(log_path, "w") as log:
            proc = subprocess.Popen([vllm, "serve", model, *args, "--port", str(port)],
                                    stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})})
        server = cls(proc, port, log_path)
        started = time.monotonic()
        next_note = started + 15
        while time.monotonic() < started + timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {proc.returncode}:\n{server.log()[-4000:]}")
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return server
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
            if waiting is not None and time.monotonic() >= next_note:
                waiting(time.monotonic() - started)
                next_note += 15
        server.stop()
        raise TimeoutError(f"vllm serve did not become healthy in {timeout} s:\n"
                           f"{server.log()[-4000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Server:
    """A benchmark's server: the process and its streamed completions."""

    def __init__(self, model: str, flags: list[str], log: Path,
                 env: dict[str, str] | None = None):
        started = time.monotonic()

        def waiting(seconds: float) -> None:
            print(f"[bench]   still starting ({seconds:.0f} s; log: {log})", flush=True)

        self.process = ServeProcess.start(model, [*SERVE_ARGS, *flags], log, timeout=900,
                                          env=env, waiting=waiting)
        self.url = self.process.url
        print(f"[bench] server up after {time.monotonic() - started:.0f} s", flush=True)

    def stop(self) -> None:
        self.process.stop()

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


def write_results(out: Path, title: str, params: dict, table: str) -> int:
    params["machine"] = machine()
    (out / "params.json").write_text(json.dumps(params, indent=1))
    (out / "results.md").write_text(
        f"# {title} ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
        f"Machine: {params['machine']}\n\n" + table)
    print(table)
    print(f"[bench] wrote {out}/results.md, params.json")
    return 0



# ---------------------------------------------------------------- arguments


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    """The options every serving benchmark takes (`./fork bench` passes them through);
    `--fleet`, `--targets` and `--recompute` tell `./fork bench` which script to run."""
    p = argparse.ArgumentParser(description=description)
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



# -------------------------------------------------------------- targets


# ~400 SmolLM2 tokens per document (bench_rag's words are ~1 token each).
TARGET_DOC_WORDS = 395


@dataclass(frozen=True)
class TargetRuns:
    """Requests of one target workload: warm-up first (not timed), then timed."""

    # Target key, e.g. "hit-8".
    name: str
    # Untimed prompts sent first, one at a time.
    warmup: list[str]
    # Timed prompts and their questions (the floor times the question alone).
    timed: list[tuple[str, str]]
    # Requests in flight at once.
    concurrency: int


def hit_runs(work: Workload, k: int, requests: int) -> TargetRuns:
    docs = make_corpus(k, work.doc_words, work.seed, f"target-hit-{k}")
    rng = random.Random(f"{work.seed}-target-hit-{k}")
    timed = []
    for i in range(requests):
        order = rng.sample(docs, k)
        question = f"Question {i}: which document is about a harbor?"
        timed.append((" ## ".join([work.system, *order, question]), question))
    warmup = [" ## ".join([work.system, *docs, "Warm-up: list the documents."])]
    return TargetRuns(f"hit-{k}", warmup, timed, 1)


def run_target(server: Server, config: str, work: Workload, runs: TargetRuns,
               progress) -> Result:
    for prompt in runs.warmup:
        server.complete(prompt, work.max_tokens)
    point = Point(int(runs.name.split("-")[1]), 0.0, runs.concurrency)
    return run_point(server, config, work, point, runs.timed, progress)



# ---------------------------------------------------------------- remap


def best_of(fn: Callable[[], object], repeat: int = 5, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


@dataclass(frozen=True)
class RemapTiming:
    """Best-of seconds for one layer's rows, and the bytes moved (K+V)."""

    plain_copy: float
    gather_write: float
    remap: float
    nbytes: int
    # The same remap with the CPU fast path turned off (the generic,
    # device-independent rotation; the same path as `remap` off the CPU).
    remap_generic: float = 0.0

    def line(self, seconds: float) -> str:
        return (f"{seconds * 1e3:8.2f} ms ({self.nbytes / seconds / 1e9:5.1f} GB/s) "
                f"= {seconds / self.plain_copy:.2f}x copy "
                f"({self.plain_copy / seconds:.0%} of copy throughput)")


def bench_remap(device: str, dtype: "torch.dtype", heads: int = 8, head_size: int = 128,
                rows: int = 16384, repeat: int = 5) -> RemapTiming:
    # NOTE: imported here: the serving benchmarks import this module without torch.
    import torch

    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.position_remapper import PositionRemapper, RemapRows, RopeRotation

    rope = get_rope(head_size, 32768, True, {"rope_type": "default"}, torch.float32)
    pool_k = torch.randn(rows, heads, head_size, device=device).to(dtype)
    pool_v = torch.randn_like(pool_k)
    paged_k = torch.zeros_like(pool_k)
    paged_v = torch.zeros_like(pool_v)

    def write_rows(layer_name, key, value, slot_mapping):
        paged_k.index_copy_(0, slot_mapping, key)
        paged_v.index_copy_(0, slot_mapping, value)

    perm = torch.randperm(rows, device=device)
    # 8 segments of rows // 8 rows, one delta each (as a load plan has).
    segment = max(rows // 8, 1)
    deltas = (torch.arange(rows) // segment * segment + 5).to(device)
    remap_rows = RemapRows(src_rows=perm, dst_slots=torch.arange(rows, device=device),
                           deltas=deltas)
    remapper = PositionRemapper(RopeRotation(rope), write_rows)
    generic = PositionRemapper(RopeRotation(rope, use_cpu_kernel=False), write_rows)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    remap = best_of(lambda: remapper.remap_layer("l", pool_k, pool_v, remap_rows),
                    repeat, sync=sync)
    remap_generic = best_of(
        lambda: generic.remap_layer("l", pool_k, pool_v, remap_rows), repeat, sync=sync)
    # NOTE: the plain copy reads and writes the same bytes as the remap: K and V
    # rows from one tensor into another (the remap also writes them once).
    plain = best_of(lambda: (paged_k.copy_(pool_k), paged_v.copy_(pool_v)), repeat,
                    sync=sync)
    copy_only = PositionRemapper(None, write_rows)
    gather = best_of(lambda: copy_only.remap_layer("l", pool_k, pool_v, remap_rows),
                     repeat, sync=sync)
    # Our part alone: gather + rotation, the write left out (in the engine it
    # is the backend's own op, outside the remapper).
    no_write = PositionRemapper(remapper.rotation, lambda *args: None)
    gather_rope = best_of(lambda: no_write.remap_layer("l", pool_k, pool_v, remap_rows),
                          repeat, sync=sync)
    timing = RemapTiming(plain, gather, remap, 2 * pool_k.numel() * pool_k.element_size(),
                         remap_generic)
    print(f"remap ({device}, {dtype}, {rows} rows x {heads} heads x {head_size}, "
          f"{timing.nbytes / 2**20:.0f} MiB K+V per layer):")
    print(f"  plain copy          {timing.line(plain)}")
    print(f"  gather+write        {timing.line(gather)}")
    print(f"  gather+rope         {timing.line(gather_rope)}  (no write)")
    if remapper.rotation.rotates_in_place(pool_k.device):
        print(f"  gather+rope+write   {timing.line(remap_generic)}  (generic rotation)")
    print(f"  gather+rope+write   {timing.line(remap)}"
          + ("  (CPU in-place kernel)" if remapper.rotation.rotates_in_place(pool_k.device)
             else ""))
    return timing



# ------------------------------------------------------- GPU documents

# Tokens per document of the GPU scripts (gpu_ttft.py, bench_host.py).
DOC_TOKENS = int(os.environ.get("DOC_TOKENS", "500"))


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                            for _ in range(rng.randint(2, 7))) for _ in range(n))


def document(rng: random.Random, tokenizer, num_tokens: int = DOC_TOKENS) -> str:
    """Random words until the text is `num_tokens` tokens long (gpu_ttft.py, bench_host.py)."""
    text = words(rng, 20)
    while len(tokenizer.encode(text, add_special_tokens=False)) < num_tokens:
        text += " " + words(rng, 5)
    return text


# ------------------------------------------------------------------- host work


def host_workload_llm(model: str, max_model_len: int, block_size: int | None = None):
    """The in-process engine bench_host.py and profile_host.py measure: dummy bf16 weights
    (compute is not what they time), the chunk cache and prefix caching on, the positions
    stretched to `max_model_len`.

    NOTE: in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): the chunk splitter and
    the scheduler live in this process, where the benchmarks look at them. `block_size`:
    vLLM's KV block size (None: the platform's default, 128 on the CPU)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "6")
    from vllm import LLM

    return LLM(model=model, load_format="dummy", dtype="bfloat16", seed=0,
               max_model_len=max_model_len,
               hf_overrides={"max_position_embeddings": max_model_len},
               enforce_eager=True, enable_chunk_cache=True, enable_prefix_caching=True,
               **({} if block_size is None else {"block_size": block_size}))
