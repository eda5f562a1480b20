# SPDX-License-Identifier: Apache-2.0
"""All-hit TTFT per `--chunk-context` mode on the benchmark's 8-document workload
(issue 11, the recommended default: best quality within 2x of `sink`'s TTFT).

Reuses the targets' all-hit workload (common.hit_runs) unchanged (8 documents of ~400 tokens, a new
order and question per request, one warm-up first) so the numbers are comparable with
docs/benchmarks.md; one `vllm serve` per mode, one after another in the same run.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

# The modes, and `sink` with the boundary-recompute lever built in the engine.
MODES = ("none", "sink", "system", "sink+first12")


def server_flags(config: str) -> list[str]:
    """`vllm serve` flags of an engine configuration (engine_runs' names)."""
    from .engine_runs import chunk_cache_args

    flags = []
    for name, value in chunk_cache_args(config).items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def measure(model: str, out: Path, requests: int = 5, max_tokens: int = 8) -> dict[str, float]:
    """Median all-hit TTFT (s) per mode."""
    # The benchmarks' shared pieces (benchmarks/common.py) live next to this package.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import TARGET_DOC_WORDS, Server, Workload, hit_runs

    work = Workload(TARGET_DOC_WORDS, requests, max_tokens,
                    "Answer the question from the documents.", 0)  # the benchmarks' default
    runs = hit_runs(work, 8, requests)
    medians = {}
    for mode in MODES:
        print(f"[eval] all-hit TTFT, 8 documents: starting the {mode} server ...", flush=True)
        server = Server(model, server_flags(mode), out / f"server-{mode}.log")
        try:
            for prompt in runs.warmup:
                server.complete(prompt, max_tokens)
            medians[mode] = statistics.median(
                server.complete(prompt, max_tokens)[0] for prompt, _ in runs.timed)
        finally:
            server.stop()
    return medians


def table(medians: dict[str, float]) -> str:
    sink = medians["sink"]
    lines = ["| mode | median all-hit TTFT, 8 docs (ms) | vs sink | within 2x of sink |",
             "|---|---|---|---|"]
    for mode, t in medians.items():
        lines.append(f"| {mode} | {t * 1e3:.1f} | {t / sink:.2f}x | "
                     f"{'yes' if t <= 2 * sink else 'no'} |")
    return "\n".join(lines) + "\n"
