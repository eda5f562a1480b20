#!/usr/bin/env python3
"""The all-hit request against vLLM's prefix cache at its best and the floor, per prompt
length (issue 52, deliverable 1).

One in-process engine (benchmarks/common.py `host_workload_llm`: tiny-llama's shapes and
tokenizer, random weights, so compute is negligible and host work is what separates the
rows; positions stretched to 132k; the chunk cache and prefix caching on). Documents of
~500 tokens. Rows, interleaved request by request, medians of warm requests:

- stock: the whole prompt unsplit (`split_chunks=False`) under a new `cache_salt` every
  request, so the prefix cache cannot hit: every token computed, as vLLM without either
  cache (plus its block hashing);
- APC-same: the same documents in the same order, unsplit, a new question: the case vLLM's
  prefix cache serves perfectly;
- chunk: the documents shuffled anew every request, all resident in the chunk cache;
- floor: the question alone.

Then the host split of one chunk all-hit request under cProfile (cumulative ms of the
front end's split, the scheduler's step, the connector's metadata and the worker's load,
and the model runner's step), and a sweep of documents per request at a fixed total.

    .cache/venv/bin/python benchmarks/bench_long_context.py [--quick] [--ids]

`--quick` (a few minutes on 2 cores): 8k and 32k, 8 warm requests a row, stock at 8k
only, the sweep at 8k. Without it: 8k, 32k, 128k (stock up to 32k: its attention is
quadratic) and the sweep at 32k as 16, 64 and 256 documents. One OpenMP thread, unbound
(OMP_NUM_THREADS and VLLM_CPU_OMP_THREADS_BIND override). `--ids`: token-id prompts
(the documents tokenized once, the separator's ids between them) instead of text.

Needs `./fork setup` (tiny-llama in .cache/models).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

# NOTE: one OpenMP thread, unbound, before torch is imported (as issue 52 measured): on
# a shared 2-core machine, threads bound to busy cores spin at every parallel region and
# the rows swing 50x with the neighbours' load; one thread keeps them comparable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

from common import document, host_workload_llm, words  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MAX_LEN = 132 * 1024
# (label, file suffix, function name): cumulative time of these in the profile.
_HOST_PARTS = (
    ("front end: split", "renderers/chunk_split.py", "split"),
    ("scheduler: schedule", "core/sched/scheduler.py", "schedule"),
    ("  of it, connector metadata", "chunk_cache/connector.py", "build_connector_meta"),
    ("worker: chunk load", "chunk_cache/worker.py", "start_load_kv"),
    ("worker: model step", "worker/cpu_model_runner.py", "execute_model"),
    ("worker: model step", "worker/gpu_model_runner.py", "execute_model"),
)


class _Rows:
    """The prompts of one size: system, documents, a new question each time."""

    def __init__(self, llm, rng: random.Random, num_docs: int, doc_tokens: int, ids: bool):
        self.llm, self.rng, self.ids = llm, rng, ids
        tok = llm.get_tokenizer()
        self.docs = [document(rng, tok, doc_tokens) for _ in range(num_docs)]
        self.system = "answer from the documents"
        if ids:
            splitter = llm.renderer._chunk_splitter
            self.sep = splitter.parser.separator_token_ids(tok)
            self.tok = tok
            self.doc_ids = [tok.encode(d, add_special_tokens=False) for d in self.docs]
            self.system_ids = tok.encode(self.system)

    def _question(self) -> str:
        return "question: " + words(self.rng, 12)

    def _prompt(self, order: list[int], salt: str | None = None) -> dict:
        if self.ids:
            ids = list(self.system_ids)
            for i in order:
                ids += self.sep + self.doc_ids[i]
            ids += self.sep + self.tok.encode(self._question(), add_special_tokens=False)
            prompt = {"prompt_token_ids": ids}
        else:
            prompt = {"prompt": " ## ".join([self.system, *[self.docs[i] for i in order],
                                             self._question()])}
        if salt is not None:
            prompt["cache_salt"] = salt
        return prompt

    def chunk(self) -> dict:
        return self._prompt(self.rng.sample(range(len(self.docs)), len(self.docs)))

    def same(self) -> dict:
        return self._prompt(list(range(len(self.docs))))

    def stock(self) -> dict:
        return self._prompt(list(range(len(self.docs))), salt=f"stock-{self.rng.random()}")

    def floor(self) -> dict:
        if self.ids:
            return {"prompt_token_ids": self.tok.encode(self._question())}
        return {"prompt": self._question()}


def _generate(llm, prompt: dict, split: bool):
    from vllm import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0)
    return llm.generate([prompt], one, use_tqdm=False,
                        tokenization_kwargs=None if split else {"split_chunks": False})[0]


def _timed(llm, prompt: dict, split: bool) -> float:
    t = time.perf_counter()
    _generate(llm, prompt, split)
    return time.perf_counter() - t


def _measure(llm, rows: _Rows, reps: int, stock_reps: int) -> dict[str, float]:
    """Median ms per row, the rows interleaved (order alternating) request by request."""
    for _ in range(2):  # every document resident; the token cache and APC's blocks warm
        _generate(llm, rows.chunk(), True)
        _generate(llm, rows.same(), False)
    times: dict[str, list[float]] = {"stock": [], "apc_same": [], "chunk": [], "floor": []}
    for rep in range(reps):
        names = ["apc_same", "chunk", "floor"] + (["stock"] if rep < stock_reps else [])
        for name in names if rep % 2 == 0 else reversed(names):
            prompt = {"stock": rows.stock, "apc_same": rows.same, "chunk": rows.chunk,
                      "floor": rows.floor}[name]()
            times[name].append(_timed(llm, prompt, split=name in ("chunk", "floor")))
    return {k: 1e3 * statistics.median(v) for k, v in times.items() if v}


def _host_split(llm, rows: _Rows) -> list[tuple[str, float]]:
    """Cumulative ms of the host parts in one chunk all-hit request under cProfile."""
    prof = cProfile.Profile()
    prompt = rows.chunk()
    prof.enable()
    _generate(llm, prompt, True)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    out: dict[str, float] = {}
    for label, suffix, name in _HOST_PARTS:
        ms = sum(1e3 * v[3] for (f, _, n), v in stats.items()
                 if n == name and f.endswith(suffix))
        if ms or label not in out:
            out[label] = ms
    total = sum(1e3 * v[2] for v in stats.values())
    return [*out.items(), ("whole request (own times summed)", total)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ids", action="store_true", help="token-id prompts instead of text")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--stock-reps", type=int, default=3)
    ap.add_argument("--model", default=str(ROOT / ".cache/models/tiny-llama"))
    args = ap.parse_args()
    sizes = [16, 64] if args.quick else [16, 64, 256]
    stock_max = 16 if args.quick else 64
    sweep_total = 8000 if args.quick else 32000
    sweep_docs = [4, 16, 64] if args.quick else [16, 64, 256]

    llm = host_workload_llm(args.model, MAX_LEN)
    rng = random.Random(0)
    form = "token ids" if args.ids else "text"
    print(f"prompts: {form}; tiny-llama shapes, random weights; medians of {args.reps} "
          f"warm requests (stock: {args.stock_reps}), rows interleaved", flush=True)
    print(f"{'docs':>5} {'tokens':>7} | {'stock ms':>9} {'APC-same':>9} {'chunk':>8} "
          f"{'floor':>7} | {'chunk/APC':>9} {'chunk/floor':>11} {'stock/chunk':>11}")
    for num_docs in sizes:
        rows = _Rows(llm, rng, num_docs, 500, args.ids)
        ms = _measure(llm, rows, args.reps,
                      args.stock_reps if num_docs <= stock_max else 0)
        tokens = len(_generate(llm, rows.chunk(), True).prompt_token_ids)
        stock = ms.get("stock")
        stock_ms = "skipped" if stock is None else f"{stock:.1f}"
        stock_ratio = "-" if stock is None else f"{stock / ms['chunk']:.1f}"
        print(f"{num_docs:>5} {tokens:>7} | "
              f"{stock_ms:>9} {ms['apc_same']:>9.1f} "
              f"{ms['chunk']:>8.1f} {ms['floor']:>7.1f} | "
              f"{ms['chunk'] / ms['apc_same']:>9.2f} {ms['chunk'] / ms['floor']:>11.2f} "
              f"{stock_ratio:>11}", flush=True)
        print("      host split of one chunk all-hit request (cProfile, cumulative ms): "
              + "; ".join(f"{k} {v:.1f}" for k, v in _host_split(llm, rows)), flush=True)

    print(f"\nsweep: {sweep_total} tokens as more, shorter documents "
          "(chunk all-hit and floor, interleaved)")
    print(f"{'docs':>5} {'doc tokens':>10} | {'chunk ms':>8} {'floor ms':>8} {'chunk/floor':>11}")
    for num_docs in sweep_docs:
        rows = _Rows(llm, rng, num_docs, sweep_total // num_docs, args.ids)
        ms = _measure(llm, rows, args.reps, 0)
        print(f"{num_docs:>5} {sweep_total // num_docs:>10} | {ms['chunk']:>8.1f} "
              f"{ms['floor']:>8.1f} {ms['chunk'] / ms['floor']:>11.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
