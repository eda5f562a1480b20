# SPDX-License-Identifier: Apache-2.0
"""Answer quality of the chunk cache per `--chunk-context` mode against full causal
attention, and the recompute levers measured before any is built (issue 11).

    ./fork eval [--quick] [--questions N] [--lever-questions M] [--out DIR]

1. Engine (the real vLLM engine, offline, float32, eager): stock vLLM and the chunk
   cache in `none`, `sink`, `system` on an offline RAG QA set
   (benchmarks/quality_eval/dataset.py): exact match, mean gold-answer
   log-likelihood, tokens computed per request, TTFT.
2. Reference (HF transformers with the isolation mask, which the engine equals by
   the project's invariant): the same modes plus the recompute levers (first K
   tokens per chunk; the r% chunk tokens with the largest KV deviation) on a
   stratified subset, and a cross-check of the engine's numbers against it.

Writes results.md, results.json, levers.png and per-step files (a rerun with the
same --out resumes: finished engine configurations and reference questions are
kept) into the results directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from quality_eval.dataset import DatasetConfig, build_dataset
from quality_eval.engine_runs import CONFIGS, EngineRun, QuestionResult, run_config
from quality_eval.prompts import encode
from quality_eval.reference import LeverGrid
from quality_eval.report import engine_table, paired_table, plot_levers, reference_table


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(os.environ.get("FORK_MODELS", ".cache/models"),
                                                    "SmolLM2-135M-Instruct"))
    p.add_argument("--quick", action="store_true",
                   help="CI smoke subset: stock and sink only, 6 engine questions, "
                        "2 reference questions, one lever each (~3 min)")
    p.add_argument("--questions", type=int, default=None,
                   help="engine questions (default: all 240)")
    p.add_argument("--lever-questions", type=int, default=40,
                   help="reference questions for the levers (half single-hop, half two-hop)")
    p.add_argument("--timed", type=int, default=48,
                   help="engine questions sent one at a time for TTFT (the rest: a batch)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="engine configurations")
    p.add_argument("--boundary-k", default="4,8,16")
    p.add_argument("--fractions", default="0.1,0.25")
    p.add_argument("--scales", default="0.5,2",
                   help="APE context scaling factors (lever c; empty: none)")
    p.add_argument("--question-fractions", default="0.1,0.2",
                   help="question-aware recompute (issue 33): fractions of chunk tokens "
                        "ranked by the question's attention (empty: none)")
    p.add_argument("--question-first", default="0",
                   help="for each question fraction, also these numbers of first tokens "
                        "per chunk, forced into the same budget (0: attention alone)")
    p.add_argument("--question-chunk-fractions", default="",
                   help="question-aware boundary recompute: fractions spent on the first "
                        "tokens of the chunks the question attends to most (empty: none)")
    p.add_argument("--modes", default="none,sink,system",
                   help="plain chunk-context modes scored in the reference (full always)")
    p.add_argument("--lever-modes", default="sink,none",
                   help="modes the reference's levers are built on")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-reference", action="store_true")
    p.add_argument("--ttft-8docs", action="store_true",
                   help="also time all-hit TTFT per mode on bench_targets' 8-document "
                        "workload (one vllm serve per mode; for the recommended default)")
    p.add_argument("--merge-reference", default="",
                   help="comma-separated results directories whose reference rows (other "
                        "levers, same questions) are merged into this run's tables per "
                        "question; the configurations both hold must agree")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results directory")
    args = p.parse_args(argv)
    if args.quick:
        # Each engine costs ~1 min of start-up on 2 cores: two of them keep the CI
        # smoke under ~3 min; the full run covers none and system.
        args.questions, args.lever_questions, args.timed = 6, 2, 2
        args.boundary_k, args.fractions, args.configs = "4", "0.25", "stock,sink"
        args.scales, args.question_fractions, args.question_first = "2", "0.1", "0"
    return args


def stratified(questions, n: int):
    """The first n/2 single-hop and n/2 two-hop questions, alternating (within a
    kind the dataset's order is already random), so any prefix is balanced too."""
    single = [q for q in questions if q.kind == "single"][: n - n // 2]
    two = [q for q in questions if q.kind == "two-hop"][: n // 2]
    out = [q for pair in zip(single, two) for q in pair]
    return out + single[len(two):] + two[len(single):]


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def run_engine(args, items, out: Path) -> list[EngineRun]:
    from tqdm import tqdm

    runs = []
    for config in args.configs.split(","):
        path = out / f"engine-{config}.json"
        if path.exists():
            data = json.loads(path.read_text())
            data["results"] = [QuestionResult(**r) for r in data["results"]]
            runs.append(EngineRun(**data))
            print(f"[eval] engine {config}: kept {path}", flush=True)
            continue
        print(f"[eval] engine {config}: starting vLLM ...", flush=True)
        with tqdm(total=len(items), desc=f"engine {config}", unit="q") as bar:
            run = run_config(config, args.model, items, args.timed, bar)
        path.write_text(json.dumps(dataclasses.asdict(run), indent=1))
        runs.append(run)
    return runs


def run_reference(args, items, out: Path) -> list[dict]:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from quality_eval.reference import ReferenceScorer

    path = out / "reference.jsonl"
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            done[row["qid"]] = row
    grid = LeverGrid(modes=_names(args.lever_modes),
                     boundary_k=tuple(int(k) for k in _names(args.boundary_k)),
                     fractions=tuple(float(r) for r in _names(args.fractions)),
                     scales=tuple(float(s) for s in _names(args.scales)),
                     question_fractions=tuple(float(r) for r in _names(args.question_fractions)),
                     question_first=tuple(int(f) for f in _names(args.question_first)),
                     question_chunk_fractions=tuple(
                         float(r) for r in _names(args.question_chunk_fractions)))
    # The deployment's sink: the tokenizer's BOS (ChunkCacheConfig's default).
    sink = AutoTokenizer.from_pretrained(args.model).bos_token_id
    scorer = None
    rows = []
    with open(path, "a") as f, tqdm(total=len(items), desc="reference", unit="q") as bar:
        for item in items:
            if item.question.qid not in done:
                scorer = scorer or ReferenceScorer(args.model, sink)
                scores = scorer.evaluate(item, _names(args.modes), grid)
                done[item.question.qid] = {"qid": item.question.qid, "scores": {
                    k: dataclasses.asdict(v) for k, v in scores.items()}}
                f.write(json.dumps(done[item.question.qid]) + "\n")
                f.flush()
            rows.append(done[item.question.qid])
            bar.update(1)
    return rows


def merge_reference(rows: list[dict], directories: tuple[str, ...]) -> list[dict]:
    """This run's reference rows with the variants of other runs on the same questions
    (a lever measured later, in another process). A question missing from a directory,
    or a shared configuration whose score differs, is an error: the tables would mix
    question sets or models."""
    merged = [{"qid": r["qid"], "scores": dict(r["scores"])} for r in rows]
    for directory in directories:
        other = {}
        for line in (Path(directory) / "reference.jsonl").read_text().splitlines():
            row = json.loads(line)
            other[row["qid"]] = row["scores"]
        for row in merged:
            if row["qid"] not in other:
                raise SystemExit(f"--merge-reference {directory}: no row for {row['qid']}")
            for name, score in other[row["qid"]].items():
                mine = row["scores"].setdefault(name, score)
                if (abs(mine["gold_logprob"] - score["gold_logprob"]) > 1e-6
                        or mine["exact"] != score["exact"]):
                    raise SystemExit(f"--merge-reference {directory}: {row['qid']} {name} "
                                     f"differs ({mine} vs {score})")
    return merged


def cross_check(runs: list[EngineRun], rows: list[dict]) -> str:
    """Engine vs reference on the questions both scored (the invariant, in numbers)."""
    ref = {r["qid"]: r["scores"] for r in rows}
    lines = ["| configuration | questions | max abs gold log-lik. diff | EM agreement |",
             "|---|---|---|---|"]
    for run in runs:
        key = "full" if run.config == "stock" else run.config
        both = [(r, ref[r.qid][key]) for r in run.results
                if r.qid in ref and key in ref[r.qid]]
        if not both:
            continue
        diff = max(abs(r.gold_logprob - s["gold_logprob"]) for r, s in both)
        agree = sum(r.exact == s["exact"] for r, s in both)
        lines.append(f"| {run.config} | {len(both)} | {diff:.2e} | {agree}/{len(both)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    out = Path(args.out or f"benchmarks/results/quality-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    dataset = build_dataset(DatasetConfig(seed=args.seed))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    questions = list(dataset.questions)
    engine_qs = stratified(questions, args.questions or len(questions))
    lever_qs = stratified(questions, args.lever_questions)
    print(f"[eval] dataset: {len(questions)} questions; engine on {len(engine_qs)}, "
          f"reference + levers on {len(lever_qs)}; results in {out}", flush=True)
    kinds = {q.qid: q.kind for q in questions}
    runs = [] if args.skip_engine else run_engine(args, [encode(tokenizer, q) for q in engine_qs],
                                                  out)
    rows = [] if args.skip_reference else run_reference(
        args, [encode(tokenizer, q) for q in lever_qs], out)
    if rows and args.merge_reference:
        rows = merge_reference(rows, _names(args.merge_reference))
    medians = {}
    if args.ttft_8docs:
        from quality_eval.mode_ttft import measure

        path = out / "ttft-8docs.json"
        if path.exists():
            medians = json.loads(path.read_text())
            print(f"[eval] all-hit TTFT: kept {path}", flush=True)
        else:
            medians = measure(args.model, out)
            path.write_text(json.dumps(medians, indent=1))
    md = [f"# Answer quality ({time.strftime('%Y-%m-%d %H:%M')})\n",
          f"Model: {args.model}; dataset: {dataclasses.asdict(dataset.config)}\n"]
    if runs:
        md += [f"## Engine (vLLM {runs[0].vllm_version}), {len(engine_qs)} questions\n",
               engine_table(runs)]
    if rows:
        md += [f"## HF reference with the isolation mask, {len(lever_qs)} questions\n",
               reference_table(rows, kinds), "\n", paired_table(rows)]
        if plot_levers(rows, out / "levers.png"):
            md.append("\n![levers](levers.png)\n")
    if runs and rows:
        md += ["## Engine vs reference on the shared questions\n", cross_check(runs, rows)]
    if medians:
        from quality_eval.mode_ttft import table

        md += ["## All-hit TTFT per mode, 8 documents of ~400 tokens (bench_targets)\n",
               table(medians)]
    text = "\n".join(md)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({
        "args": vars(args), "dataset": dataclasses.asdict(dataset.config),
        "engine": [dataclasses.asdict(r) for r in runs], "reference": rows,
        "ttft_8docs": medians}, indent=1))
    print(text)
    print(f"[eval] wrote {out}/results.md, results.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
