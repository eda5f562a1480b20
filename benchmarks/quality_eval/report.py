# SPDX-License-Identifier: Apache-2.0
"""Tables (markdown) and the lever plot of the quality evaluation."""

from __future__ import annotations

import statistics
from pathlib import Path

from .engine_runs import EngineRun, summarize


def engine_table(runs: list[EngineRun]) -> str:
    lines = ["| configuration | EM all | EM single | EM two-hop | gold log-lik. | prompt tok. "
             "| computed tok./request | TTFT median ms (stream) | TTFT median ms (all hit) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        a, s, t = summarize(run), summarize(run, "single"), summarize(run, "two-hop")
        warm = "-" if a["warm_ttft_median_s"] is None else f"{a['warm_ttft_median_s'] * 1e3:.0f}"
        name = "full causal (stock)" if run.config == "stock" else f"chunk cache `{run.config}`"
        lines.append(f"| {name} | {a['exact_match']:.1%} | {s['exact_match']:.1%} | "
                     f"{t['exact_match']:.1%} | {a['gold_logprob']:.3f} | "
                     f"{a['prompt_tokens']:.0f} | {a['computed_tokens']:.1f} | "
                     f"{a['ttft_median_s'] * 1e3:.0f} | {warm} |")
    lines.append(f"\nTTFT: medians over the first {summarize(runs[0])['timed']} questions, sent "
                 "one at a time; the rest were sent as one batch (no TTFT).")
    return "\n".join(lines) + "\n"


def aggregate(rows: list[dict]) -> dict[str, dict]:
    """rows: one {variant: {gold_logprob, exact, recomputed, chunk_tokens}} per question.
    Only the variants every row has (a resumed run may have measured a variant on its
    first questions only; a table mixing question sets would not compare)."""
    out = {}
    for name in [n for n in rows[0] if all(n in r for r in rows)]:
        scores = [r[name] for r in rows]
        out[name] = {
            "gold_logprob": statistics.fmean(s["gold_logprob"] for s in scores),
            "exact_match": statistics.fmean(s["exact"] for s in scores),
            "recomputed_fraction": sum(s["recomputed"] for s in scores)
            / sum(s["chunk_tokens"] for s in scores),
        }
    return out


def _gap(agg: dict, name: str, metric: str = "gold_logprob") -> str:
    """Share of the gap between `sink` (the default) and full attention that this
    configuration closes, in `metric`: issue 11's bar for building a lever is >= 50% of
    the gold-log-likelihood gap at <= 25% of chunk tokens recomputed, whatever the
    lever's base mode (issue 33's: >= 80% at <= 20%)."""
    if name in ("full", "sink") or "sink" not in agg:
        return "-"
    gap = agg["full"][metric] - agg["sink"][metric]
    if abs(gap) < 1e-9:
        return "-"
    return f"{(agg[name][metric] - agg['sink'][metric]) / gap:.0%}"


def reference_table(rows: list[dict], kinds: dict[str, str]) -> str:
    """kinds: qid -> single / two-hop, to split EM."""
    agg = aggregate([r["scores"] for r in rows])
    single = aggregate([r["scores"] for r in rows if kinds[r["qid"]] == "single"])
    two = aggregate([r["scores"] for r in rows if kinds[r["qid"]] == "two-hop"])
    lines = ["| configuration | chunk tokens recomputed | EM all | EM single | EM two-hop "
             "| gold log-lik. | sink-to-full gap closed | EM gap closed |",
             "|---|---|---|---|---|---|---|---|"]
    for name, a in agg.items():
        lines.append(f"| {name} | {a['recomputed_fraction']:.1%} | {a['exact_match']:.1%} | "
                     f"{single[name]['exact_match']:.1%} | {two[name]['exact_match']:.1%} | "
                     f"{a['gold_logprob']:.3f} | {_gap(agg, name)} | "
                     f"{_gap(agg, name, 'exact_match')} |")
    return "\n".join(lines) + "\n"


def _series(agg: dict, mode: str) -> list[tuple[list[str], str, str]]:
    """The recompute curves of one base mode: (variant names, line style, label)."""
    out = []
    for prefix, style, label in (("first", "o-", "first K tokens"),
                                 ("blend", "s--", "top-r% KV deviation (CacheBlend)")):
        names = [n for n in agg if n.startswith(f"{mode}+{prefix}")]
        if names:
            out.append((names, style, label))
    chunks = [n for n in agg if n.startswith(f"{mode}+qchunk")]
    if chunks:
        out.append((chunks, "P-.", "first tokens of the most question-attended chunks"))
    qa = [n for n in agg if n.startswith(f"{mode}+qa")]
    for first in sorted({n.partition("+first")[2] for n in qa}, key=lambda f: int(f or 0)):
        names = [n for n in qa if n.partition("+first")[2] == first]
        out.append((names, "d-." if not first else "v-.",
                    "top-r% question attention" + (f" + first {first}" if first else "")))
    return out


def paired_table(rows: list[dict], boot: int = 2000, seed: int = 0) -> str:
    """Per configuration: the paired gold-log-likelihood difference to `sink` (mean +-
    standard error over the questions), and a 90% bootstrap interval (questions
    resampled with replacement, `seed` fixed) of the share of the sink-to-full gap
    it closes - how much of a gap percentage is the question sample."""
    import random

    scores = [r["scores"] for r in rows]
    if "sink" not in scores[0] or "full" not in scores[0] or len(scores) < 2:
        return ""
    rng = random.Random(seed)
    draws = [[rng.randrange(len(scores)) for _ in scores] for _ in range(boot)]
    lines = ["| configuration | gold log-lik. - sink (paired, +- s.e.) "
             "| sink-to-full gap closed, 90% bootstrap interval |", "|---|---|---|"]
    for name in [n for n in scores[0] if all(n in s for s in scores)]:
        if name == "sink":
            continue
        diff = [s[name]["gold_logprob"] - s["sink"]["gold_logprob"] for s in scores]
        gap = [s["full"]["gold_logprob"] - s["sink"]["gold_logprob"] for s in scores]
        se = statistics.stdev(diff) / len(diff) ** 0.5
        shares = sorted(sum(diff[i] for i in d) / sum(gap[i] for i in d) for d in draws)
        interval = ("-" if name == "full" else
                    f"{shares[int(0.05 * boot)]:.0%} to {shares[int(0.95 * boot) - 1]:.0%}")
        lines.append(f"| {name} | {statistics.fmean(diff):+.3f} +- {se:.3f} | {interval} |")
    return "\n".join(lines) + "\n"


def plot_levers(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    agg = aggregate([r["scores"] for r in rows])
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode, colour in (("sink", "tab:blue"), ("none", "tab:orange")):
        if mode not in agg:
            continue
        for names, style, label in _series(agg, mode):
            pts = sorted([(0.0, agg[mode]["gold_logprob"])]
                         + [(agg[n]["recomputed_fraction"], agg[n]["gold_logprob"])
                            for n in names])
            ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], style, color=colour,
                    label=f"{mode} + {label}")
        for name in [n for n in agg if n.startswith(f"{mode}+scale")]:
            ax.plot([0.0], [agg[name]["gold_logprob"]], "^", color=colour, alpha=0.6,
                    label=f"{mode} + context scaling {name.rsplit('scale', 1)[1]} (APE)")
    for name, colour in (("full", "black"), ("system", "tab:green")):
        if name in agg:
            ax.axhline(agg[name]["gold_logprob"], color=colour, linestyle=":",
                       label=f"{name} (no recompute)" if name == "system"
                       else "full causal attention")
    ax.set_xlabel("chunk tokens recomputed (%)")
    ax.set_ylabel("mean gold-answer log-likelihood")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
