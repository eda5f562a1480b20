"""The TTFT ratios of one GPU run (issue 40): reads the JSON lines that
benchmarks/gpu_ttft.py printed into the given logs (any order, any other lines
ignored) and prints, per prompt size, the chunk cache's all-hit median against the
floor (the question alone on the same engine) and stock vLLM's median against the
chunk cache's, the chunk cache's against APC-same (mode `apc`: vLLM's prefix cache with
the same documents in the same order, issue 60) where a run measured it, and `sink+K`
against `sink` where a run measured both; each with the issue's target. Figures missing
from the logs are named as missing.

    python3 tools/gpu/ttft_ratios.py LOG...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# size -> (chunk / floor at most, stock / chunk at least): issue 40's targets.
TARGETS = {8192: (1.3, 10.0), 32768: (2.0, 25.0)}
K_TARGET = 1.3  # sink+K12 / sink at 8k, at most
APC_TARGET = 1.2  # chunk / APC-same at 8k and 32k, at most (issue 60)


def read_rows(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        for line in Path(path).read_text(errors="replace").splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "size" in row and "ttft_ms_median" in row:
                rows.append(row)
    return rows


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def ratios(rows: list[dict]) -> list[str]:
    # The K = 0 engines' rows; a TTFT_RECOMPUTE_K engine's rows are compared among
    # themselves only.
    by = {(r["mode"], r["size"]): r for r in rows if not r.get("engine_recompute_k")}
    with_k = [r for r in rows if r.get("engine_recompute_k")]
    sizes = sorted({r["size"] for r in rows})
    lines = []
    for size in sizes:
        chunk, stock = by.get(("chunk", size)), by.get(("stock", size))
        max_floor, min_stock = TARGETS.get(size, (None, None))
        parts = [f"{size} tokens:"]
        if chunk is None:
            parts.append("chunk cache missing")
        else:
            parts.append(f"chunk {chunk['ttft_ms_median']:.2f} ms "
                         f"(cached {chunk.get('cached_tokens_mean', '?')} of "
                         f"{chunk.get('prompt_tokens_mean', '?')})")
            floor = chunk.get("floor_ms_median")
            if floor:
                r = chunk["ttft_ms_median"] / floor
                parts.append(f"floor {floor:.2f} ms: {r:.2f}x the floor" + (
                    f" (target <= {max_floor}x: {_verdict(r <= max_floor)})"
                    if max_floor else ""))
            else:
                parts.append("floor missing")
        if stock is None:
            parts.append("stock missing")
        else:
            parts.append(f"stock {stock['ttft_ms_median']:.2f} ms")
            if chunk is not None:
                r = stock["ttft_ms_median"] / chunk["ttft_ms_median"]
                parts.append(f"{r:.1f}x below stock" + (
                    f" (target >= {min_stock}x: {_verdict(r >= min_stock)})"
                    if min_stock else ""))
        apc = by.get(("apc", size))
        if apc is not None and chunk is not None:
            r = chunk["ttft_ms_median"] / apc["ttft_ms_median"]
            parts.append(f"APC-same {apc['ttft_ms_median']:.2f} ms (cached "
                         f"{apc.get('cached_tokens_mean', '?')}): chunk {r:.2f}x APC-same"
                         f" (target <= {APC_TARGET}x: {_verdict(r <= APC_TARGET)})")
        lines.append(parts[0] + " " + "; ".join(parts[1:]))
        for row in with_k:
            mode = row["mode"]
            if row["size"] != size or not mode.startswith("chunk+K"):
                continue
            # NOTE: `sink` from the same engine and requests (TTFT_RECOMPUTE_K), not
            # the K = 0 engine's row above.
            sink = next((r for r in with_k if r["mode"] == "chunk" and r["size"] == size
                         and r["engine_recompute_k"] == row["engine_recompute_k"]), None)
            if sink is None:
                lines.append(f"{size} tokens: {mode} {row['ttft_ms_median']:.2f} ms; "
                             "sink of the same engine missing")
                continue
            r = row["ttft_ms_median"] / sink["ttft_ms_median"]
            lines.append(f"{size} tokens: sink+{mode[len('chunk+'):]} "
                         f"{row['ttft_ms_median']:.2f} ms vs sink {sink['ttft_ms_median']:.2f}"
                         f" ms (same engine): {r:.2f}x" + (
                             f" (target <= {K_TARGET}x: {_verdict(r <= K_TARGET)})"
                             if size == 8192 else ""))
    return lines or ["no TTFT rows in the logs"]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    existing = [a for a in argv if Path(a).exists()]
    for line in ratios(read_rows(existing)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
