#!/usr/bin/env bash
# On the GPU machine, the last call of the next run (docs/gpu.md, "Next run"): install, then
# issue 40's measurements in its priority order, each item under `timeout` with its own time
# box, until the budget is spent (at most ~8 minutes of commands: --budget 480):
#   1. the MLA exactness rows (gpu-deepseek, bf16, each engine in a process of its own):
#      TRITON_MLA, FLASH_ATTN_MLA, FLASHMLA;
#   2. TTFT at 8k and 32k tokens: the chunk cache with its floor, then stock vLLM, in the
#      same run; the ratios (tools/gpu/ttft_ratios.py) close the summary;
#   3. `sink+K12` vs `sink` TTFT at 8k (one engine, paired requests);
#   4. the launch-geometry sweep of the fused kernels (gpu_remap.py --sweep quick).
#
#   bash tools/gpu/issue40.sh [--budget SECONDS] [--only ITEM,...] [--dry-run]
#
# --budget   wall seconds for the whole script, install included (default 480). An item runs
#            only if at least its minimum is left, for at most min(its box, what is left).
# --only     run only these items (install always runs); names below.
# --dry-run  run nothing: print the plan as if every item used its whole box (checks the
#            argument parsing and the time-box arithmetic on a machine without a GPU).
# Writes $OUT/summary.txt (every figure, one screen; also printed at the end) and
# $OUT/logs.tar.gz (each item's full log; the device tool returns at most 8 files).
set -uo pipefail

ITEMS=(  # name  box(s)  min(s)  what (issue 40 priority)
  "mla-triton 190 150 MLA: gpu-deepseek on TRITON_MLA, bf16, vs the HF reference, each engine in its own process"
  "mla-fa 170 150 MLA: gpu-deepseek on FLASH_ATTN_MLA, bf16, each engine in its own process"
  "mla-flashmla 170 150 MLA: gpu-deepseek on FLASHMLA, bf16, each engine in its own process"
  "ttft-chunk 200 120 TTFT at 8k and 32k: chunk cache and floor, median of 10"
  "ttft-stock 150 90 TTFT at 8k and 32k: stock vLLM (no prefix caching), median of 5"
  "ttft-k12 150 100 TTFT at 8k: sink+K12 vs sink on one engine, median of 10 pairs"
  "remap 60 25 launch-geometry sweep of the fused load and capture (gpu_remap.py --sweep quick --sweep-only)"
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
    *) echo "issue40.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ $budget =~ ^[0-9]+$ ]] && [ "$budget" -gt 0 ] || { echo "issue40.sh: --budget takes whole seconds > 0, got '$budget'" >&2; exit 2; }
names=" "; for i in "${ITEMS[@]}"; do names+="${i%% *} "; done
for n in ${only//,/ }; do
  [[ $names == *" $n "* ]] || { echo "issue40.sh: unknown item '$n' (items:$names)" >&2; exit 2; }
done

cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; LOGS=/tmp/i40; export M=/tmp/models
mkdir -p "$OUT" "$LOGS"
summary=$OUT/summary.txt; : > "$summary"
start=$SECONDS spent_dry=0
elapsed() { echo $(( SECONDS - start + spent_dry )); }
say() { echo "$*" | cut -c1-200 >> "$summary"; }
pack_logs() { tar czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; }

export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 FORK_MODELS=$M

half() {  # half ENV...: the half-precision exactness test (tests/e2e) under these settings
  # NOTE: CHUNK_HALF_ISOLATE=1: each engine in a process of its own (vLLM's memory profiling
  # of a second engine in one process failed on 2026-11-26); its rows print as they come.
  env CHUNK_HALF_GPU_UTIL=0.3 CHUNK_HALF_EAGER=0 CHUNK_HALF_ISOLATE=1 "$@" \
    python3 -m pytest -s -q -p no:cacheprovider tests/e2e/test_chunk_cache_half_precision.py -m "" -k within_3x
}
ttft() {  # ttft MODE SIZES REPS [ENV...]: benchmarks/gpu_ttft.py on Llama-3-8B shapes
  local mode=$1 sizes=$2 reps=$3; shift 3
  env TTFT_SIZES=$sizes TTFT_REPS=$reps TTFT_DECODE=0 "$@" python3 benchmarks/gpu_ttft.py "$mode" $M/llama3-8b
}

run_item() {  # the command of one item; its output goes to the item's log
  case $1 in
    mla-triton) half CHUNK_HALF_MODEL=$M/gpu-deepseek CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_BACKEND=TRITON_MLA ;;
    mla-fa) half CHUNK_HALF_MODEL=$M/gpu-deepseek CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_BACKEND=FLASH_ATTN_MLA ;;
    mla-flashmla) half CHUNK_HALF_MODEL=$M/gpu-deepseek CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_BACKEND=FLASHMLA ;;
    ttft-chunk) ttft chunk 8192,32768 10 ;;
    ttft-stock) ttft stock 8192,32768 5 ;;
    ttft-k12) ttft chunk 8192 10 TTFT_RECOMPUTE_K=12 ;;
    remap) python3 benchmarks/gpu_remap.py --sweep quick --sweep-only ;;
  esac
}

export -f run_item half ttft

figures() {  # figures ITEM LOG: the lines of the summary that carry the item's figures
  local log=$2
  case $1 in
    mla-*)
      grep -oE "dtype=[a-z0-9]+ eager=.*" "$log" | head -2
      grep -E "^half-precision row: engine=" "$log" | wc -l | sed 's/^/rows printed: /' 
      grep -oE "Chunk cache: (loads use|captures run|[0-9]+ MLA layer).*" "$log" | sort -u | cut -c1-150 | head -3
      grep -o "'cudagraph_mode': <CUDAGraphMode\.[A-Z_]*" "$log" | sort | uniq -c | head -2
      grep -o "Using [A-Z_0-9]* \(attention \)\{0,1\}backend\|Using [A-Za-z_0-9]* MLA prefill backend" "$log" | sort -u | head -2
      grep -E "^E .*(Error|assert)" "$log" | cut -c1-150 | head -2
      grep -E "[0-9]+ (passed|failed|error|skipped)" "$log" | tail -1 ;;
    remap) grep -E "^device|copy:|^sweep|best" "$log" | head -6
           grep -E "^(load|capture) .* False *$" "$log" | head -3 ;;
    ttft-*) grep -E '^\{' "$log" | cut -c1-200 | head -6
          grep -E "Error" "$log" | tail -1 ;;
  esac
}

say "issue 40, $(date -u +%FT%TZ), budget ${budget}s$( ((dry)) && echo ', DRY RUN')"
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
if ! ((dry)); then
  say "TTFT ratios (tools/gpu/ttft_ratios.py):"
  python3 tools/gpu/ttft_ratios.py "$LOGS"/ttft-*.log 2>&1 | while IFS= read -r line; do say "  $line"; done
fi
say "total $(elapsed)s of ${budget}s"
pack_logs
cat "$summary"
((install_ok))
