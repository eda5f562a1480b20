#!/usr/bin/env bash
# Issue 51's check: the scheduler side's host time per step (bench_connector_meta.py)
# at b9f39dd (before the scheduler redesign) against a given worktree, interleaved runs.
#
#   benchmarks/bench_connector_meta_ab.sh WORKTREE [RUNS=3] [REPEAT=1000] [DOCS="8 64"]
#
# WORKTREE must have its .cache/venv (and .cache/downloads). A b9f39dd worktree is made at
# $B9_WORKTREE (default: next to WORKTREE) with a copy of WORKTREE's venv, unless it exists; one
# made here is removed at the end. `./fork env` is run in both, so each venv holds its own
# commit's patches and overlay. Both run the benchmark file as of 819f8ac (the one that
# times the step's hooks), copied to /tmp, so the same work is measured on both.
# Prints each run's raw tables to $LOG (default /tmp/meta-bench.<pid>) and a summary:
# per commit, N and phase, the median over runs of each run's median, and min..max.
set -euo pipefail
WT=$(realpath "${1:?usage: $0 WORKTREE [RUNS] [REPEAT] [DOCS]}")
RUNS=${2:-3}; REPEAT=${3:-1000}; DOCS=${4:-"8 64"}
BASE=b9f39dd
B9=${B9_WORKTREE:-$(dirname "$WT")/wt-b9f39dd}
LOG=${LOG:-/tmp/meta-bench.$$}
mkdir -p "$LOG"
created=0
cleanup() { if [ "$created" = 1 ]; then git -C "$WT" worktree remove --force "$B9"; fi; }
trap cleanup EXIT
if [ ! -d "$B9" ]; then
  git -C "$WT" worktree add --detach "$B9" "$BASE" >/dev/null
  created=1
  mkdir -p "$B9/.cache"
  nice cp -a "$WT/.cache/venv" "$B9/.cache/venv"
  ln -s "$(realpath "$WT/.cache/downloads")" "$B9/.cache/downloads"
fi
(cd "$WT" && nice ./fork env >/dev/null)
(cd "$B9" && nice ./fork env >/dev/null)
BENCH=/tmp/bench_connector_meta_819f8ac.py
git -C "$WT" show 819f8ac:benchmarks/bench_connector_meta.py > "$BENCH"
WT_REV=$(git -C "$WT" rev-parse --short HEAD)$(git -C "$WT" diff --quiet HEAD -- vllm patches || echo +dirty)
lscpu | grep -i 'model name' | tee "$LOG/machine"
one() {  # one run: $1 label, $2 worktree, $3 run index
  uptime >> "$LOG/uptime"
  (cd "$2" && nice .cache/venv/bin/python "$BENCH" --docs $DOCS --repeat "$REPEAT" \
     2>/dev/null | grep '^|' > "$LOG/$1.$3.txt")
}
for i in $(seq 1 "$RUNS"); do
  if [ $((i % 2)) = 1 ]; then one base "$B9" "$i"; one head "$WT" "$i"
  else one head "$WT" "$i"; one base "$B9" "$i"; fi
done
echo "load averages during the runs:"; sed 's/.*load average/  load average/' "$LOG/uptime"
python3 - "$LOG" "$RUNS" "$BASE" "$WT_REV" <<'EOF'
import statistics, sys
log, runs, base, head = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def rows(path):
    out = {}
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if not cells[0].isdigit():
            continue
        n = int(cells[0])
        if len(cells) == 8:   # loads table: build, hooks
            out[(n, "loads: hooks+build")] = float(cells[3])
            out[(n, "loads: build only")] = float(cells[2])
            out[(n, "loads: rows/bytes")] = f"{cells[1]}/{cells[5]}"
        elif len(cells) == 6:  # captures table: build
            out[(n, "captures: build")] = float(cells[2])
            out[(n, "captures: rows/bytes")] = f"{cells[1]}/{cells[4]}"
    return out
data = {lab: [rows(f"{log}/{lab}.{i}.txt") for i in range(1, runs + 1)] for lab in ("base", "head")}
print(f"ms per step, median of {runs} runs' medians [min..max]")
print(f"| N | phase | {base} | {head} | change |")
print("|---|---|---|---|---|")
for key in sorted(data["base"][0]):
    b = [r[key] for r in data["base"]]; h = [r[key] for r in data["head"]]
    if isinstance(b[0], str):
        print(f"| {key[0]} | {key[1]} | {b[0]} | {h[0]} | {'same' if set(b) == set(h) else 'DIFFERENT WORK'} |")
        continue
    mb, mh = statistics.median(b), statistics.median(h)
    print(f"| {key[0]} | {key[1]} | {mb:.3f} [{min(b):.3f}..{max(b):.3f}] "
          f"| {mh:.3f} [{min(h):.3f}..{max(h):.3f}] | {100 * (mh - mb) / mb:+.0f}% |")
EOF
echo "raw tables: $LOG"
