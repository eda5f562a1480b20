#!/usr/bin/env bash
# On the GPU machine, the last call of the next run (docs/gpu.md, "Next run (15 minutes of
# device time)"): install, then what the 2026-11-25 run left of issue 34, in priority order,
# each item under `timeout` with its own time box, until the budget is spent.
#
#   bash tools/gpu/issue34.sh [--budget SECONDS] [--only ITEM,...] [--dry-run]
#
# --budget   wall seconds for the whole script, install included (default 480). An item runs
#            only if at least its minimum is left, for at most min(its box, what is left).
# --only     run only these items (install always runs); names below.
# --dry-run  run nothing: print the plan as if every item used its whole box (checks the
#            argument parsing and the time-box arithmetic on a machine without a GPU).
# Writes $OUT/summary.txt (every figure, one screen; also printed at the end) and
# $OUT/logs.tar.gz (each item's full log; the device tool returns at most 8 files).
set -uo pipefail

ITEMS=(  # name  box(s)  min(s)  what (issue 34 item)
  "unit 120 30 GPU-only unit tests, TRITON_INTERPRET=0 (fused load fp8, self-check fp8, MLA writers vs CUDA)"
  "half-fa-fp16 170 100 fp16 exactness, FLASH_ATTN, default compilation (full CUDA graphs)"
  "half-triton-fp16 150 90 fp16 exactness, TRITON_ATTN, default compilation"
  "remap 90 30 fused load vs copy bandwidth (gpu_remap.py --sweep quick)"
  "mla-triton 180 100 MLA: gpu-deepseek on TRITON_MLA, bf16, vs the HF reference"
  "ttft 200 120 TTFT at 8k: chunk cache and floor, median of 10"
  "mla-fa 150 90 MLA: gpu-deepseek on FLASH_ATTN_MLA, bf16"
  "mla-flashmla 150 90 MLA: gpu-deepseek on FLASHMLA, bf16"
)
INSTALL_BOX=150

usage() { sed -n 2,15p "$0" | sed 's/^# \{0,1\}//'; printf '\nitems: '; for i in "${ITEMS[@]}"; do printf '%s ' "${i%% *}"; done; echo; }
budget=480 only="" dry=0
while [ $# -gt 0 ]; do
  case $1 in
    --budget) budget=${2:-}; shift 2 || { usage >&2; exit 2; } ;;
    --budget=*) budget=${1#*=}; shift ;;
    --only) only=${2:-}; shift 2 || { usage >&2; exit 2; } ;;
    --only=*) only=${1#*=}; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "issue34.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ $budget =~ ^[0-9]+$ ]] && [ "$budget" -gt 0 ] || { echo "issue34.sh: --budget takes whole seconds > 0, got '$budget'" >&2; exit 2; }
names=" "; for i in "${ITEMS[@]}"; do names+="${i%% *} "; done
for n in ${only//,/ }; do
  [[ $names == *" $n "* ]] || { echo "issue34.sh: unknown item '$n' (items:$names)" >&2; exit 2; }
done

cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; LOGS=/tmp/i34; export M=/tmp/models
mkdir -p "$OUT" "$LOGS"
summary=$OUT/summary.txt; : > "$summary"
start=$SECONDS spent_dry=0
elapsed() { echo $(( SECONDS - start + spent_dry )); }
say() { echo "$*" | cut -c1-200 >> "$summary"; }
pack_logs() { tar czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; }

export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 FORK_MODELS=$M

half() {  # half ENV...: the half-precision exactness test (tests/e2e) under these settings
  env CHUNK_HALF_GPU_UTIL=0.3 CHUNK_HALF_EAGER=0 "$@" python3 -m pytest -s -q -p no:cacheprovider \
    tests/e2e/test_chunk_cache_half_precision.py -m "" -k within_3x
}

run_item() {  # the command of one item; its output goes to the item's log
  case $1 in
    unit)  # every test marked GPU-only (tools/gpu/gpu_only.py), in the files that have one
      PYTHONPATH=$PYTHONPATH:$PWD/tools/gpu TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
        -rs -p gpu_only $(grep -rl 'reason="GPU-only' tests/unit) ;;
    half-fa-fp16) half CHUNK_HALF_MODEL=$M/gpu-llama CHUNK_HALF_DTYPES=float16 CHUNK_HALF_BACKEND=FLASH_ATTN ;;
    half-triton-fp16) half CHUNK_HALF_MODEL=$M/gpu-llama CHUNK_HALF_DTYPES=float16 CHUNK_HALF_BACKEND=TRITON_ATTN ;;
    remap)
      # NOTE: --sweep quick comes with the launch-geometry sweep (branch kgeom); without it
      # the script takes no arguments and runs its fixed 1k-64k rows.
      if grep -q -- "--sweep" benchmarks/gpu_remap.py; then python3 benchmarks/gpu_remap.py --sweep quick
      else python3 benchmarks/gpu_remap.py; fi ;;
    mla-triton) half CHUNK_HALF_MODEL=$M/gpu-deepseek CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_BACKEND=TRITON_MLA ;;
    mla-fa) half CHUNK_HALF_MODEL=$M/gpu-deepseek CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_BACKEND=FLASH_ATTN_MLA ;;
    mla-flashmla) half CHUNK_HALF_MODEL=$M/gpu-deepseek CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_BACKEND=FLASHMLA ;;
    ttft) TTFT_SIZES=8192 TTFT_REPS=10 TTFT_DECODE=0 python3 benchmarks/gpu_ttft.py chunk $M/llama3-8b ;;
  esac
}

export -f run_item half

figures() {  # figures ITEM LOG: the lines of the summary that carry the item's figures
  local log=$2
  case $1 in
    unit) grep -E "^(FAILED|ERROR)" "$log" | cut -c1-150 | head -4
          grep -E "[0-9]+ (passed|failed|error|skipped)" "$log" | tail -1 ;;
    half-*|mla-*)
      grep -oE "dtype=[a-z0-9]+ eager=.*" "$log" | head -2
      grep -oE "Chunk cache: (loads use|captures run|[0-9]+ MLA layer).*" "$log" | sort -u | cut -c1-150 | head -3
      grep -o "'cudagraph_mode': <CUDAGraphMode\.[A-Z_]*" "$log" | sort | uniq -c | head -2
      grep -o "Using [A-Z_0-9]* \(attention \)\{0,1\}backend\|Using [A-Za-z_0-9]* MLA prefill backend" "$log" | sort -u | head -2
      grep -E "^E .*(Error|assert)" "$log" | cut -c1-150 | head -2
      grep -E "[0-9]+ (passed|failed|error|skipped)" "$log" | tail -1 ;;
    remap) grep -E "^device|copy:|^(fused|per-|capture)|geometr|best" "$log" | head -14 ;;
    ttft) grep -E '^\{' "$log" | cut -c1-200 | head -3
          grep -E "Error" "$log" | tail -1 ;;
  esac
}

say "issue 34, $(date -u +%FT%TZ), budget ${budget}s$( ((dry)) && echo ', DRY RUN')"
# --- install (always; nothing else runs without it)
if ((dry)); then
  say "install: dry-run, box ${INSTALL_BOX}s"; spent_dry=$INSTALL_BOX; install_ok=1
else
  timeout -k 10 $INSTALL_BOX bash -c '
    set -e
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    bash tools/gpu/install.sh
    [ -e /tmp/models/.done ] || { python3 tools/gpu/make_models.py /tmp/models && touch /tmp/models/.done; }
    python3 -c "import torch, transformers, triton, vllm; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__, \"vllm\", vllm.__version__)"
    # NOTE: the extensions load here or not at all: one failure instead of one per item.
    python3 -c "import vllm._C, vllm._C_stable_libtorch; from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported as s; print(\"FA3\", s(3))"
  ' > "$LOGS/install.log" 2>&1
  rc=$?; install_ok=$(( rc == 0 ))
  say "install: rc=$rc ($(elapsed)s) | $(head -1 "$LOGS/install.log") | $(grep -E '^torch ' "$LOGS/install.log" | tail -1) | $(grep -E '^FA3 ' "$LOGS/install.log" | tail -1)"
  ((install_ok)) || { tail -5 "$LOGS/install.log" | cut -c1-200 >> "$summary"; }
fi
pack_logs

for i in "${ITEMS[@]}"; do
  read -r name box min what <<< "$i"
  [ -n "$only" ] && [[ ",$only," != *",$name,"* ]] && continue
  left=$(( budget - $(elapsed) ))
  if ! ((install_ok)); then say "$name: skipped (install failed) - $what"; continue; fi
  if (( left < min )); then say "$name: skipped (${left}s left < ${min}s) - $what"; continue; fi
  t=$(( box < left ? box : left ))
  if ((dry)); then say "$name: dry-run, would run <= ${t}s (box $box, ${left}s left) - $what"
    spent_dry=$(( spent_dry + t )); continue; fi
  t0=$SECONDS
  # NOTE: GNU timeout signals its whole process group: pytest, an engine and its workers.
  timeout -k 10 "$t" bash -c 'run_item "$1"' _ "$name" > "$LOGS/$name.log" 2>&1
  rc=$?
  note=""; ((rc == 124 || rc == 137)) && note=", stopped at its ${t}s box"
  say "$name: rc=$rc ($(( SECONDS - t0 ))s$note) - $what"
  figures "$name" "$LOGS/$name.log" | while IFS= read -r line; do say "  $line"; done
  pack_logs
done
say "total $(elapsed)s of ${budget}s"
pack_logs
cat "$summary"
((install_ok))
