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
# --budget SECONDS (default 480), --only ITEM,... (install always runs), --dry-run (the plan
# only): tools/gpu/harness.sh, which runs the items, says what each does. Writes
# $OUT/summary.txt and $OUT/logs.tar.gz.
set -uo pipefail

SCRIPT=issue40.sh ISSUE="issue 40" LOGS=/tmp/i40 USAGE_LINES=16
ITEMS=(  # name  box(s)  min(s)  what (issue 40 priority)
  "mla-triton 190 150 MLA: gpu-deepseek on TRITON_MLA, bf16, vs the HF reference, each engine in its own process"
  "mla-fa 170 150 MLA: gpu-deepseek on FLASH_ATTN_MLA, bf16, each engine in its own process"
  "mla-flashmla 170 150 MLA: gpu-deepseek on FLASHMLA, bf16, each engine in its own process"
  "ttft-chunk 200 120 TTFT at 8k and 32k: chunk cache and floor, median of 10"
  "ttft-stock 150 90 TTFT at 8k and 32k: stock vLLM (no prefix caching), median of 5"
  "ttft-k12 150 100 TTFT at 8k: sink+K12 vs sink on one engine, median of 10 pairs"
  "k12-1step 170 120 one-step recompute on CUDA (opt-in): gpu-llama fp16 FLASH_ATTN K=4 PIECEWISE vs the HF reference, then TTFT sink+K12 vs sink at 8k"
  "remap 60 25 launch-geometry sweep of the fused load and capture (gpu_remap.py --sweep quick --sweep-only)"
  "window-triton 120 70 sliding window on TRITON_ATTN (issue 52): gpu-window fp16, eager, vs the HF windowed reference"
  "window-fa 120 70 sliding window on FLASH_ATTN (issue 52): gpu-window fp16, eager, vs the HF windowed reference"
  "ttft-profile 150 100 TTFT at 32k under the torch profiler: where the all-hit request's time above the floor goes"
)

source "$(dirname "$0")/items.sh"  # half, ttft

run_item() {  # the command of one item; its output goes to the item's log
  case $1 in
    mla-triton) half CHUNK_HALF_MODEL=$M/gpu-deepseek CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_BACKEND=TRITON_MLA ;;
    mla-fa) half CHUNK_HALF_MODEL=$M/gpu-deepseek CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_BACKEND=FLASH_ATTN_MLA ;;
    mla-flashmla) half CHUNK_HALF_MODEL=$M/gpu-deepseek CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_BACKEND=FLASHMLA ;;
    ttft-chunk) ttft chunk 8192,32768 10 ;;
    ttft-stock) ttft stock 8192,32768 5 ;;
    ttft-k12) ttft chunk 8192 10 TTFT_RECOMPUTE_K=12 ;;
    k12-1step)  # NOTE: experimental (recompute_step.py): exactness first, then its speed
      half CHUNK_HALF_MODEL=$M/gpu-llama CHUNK_HALF_DTYPES=float16 CHUNK_HALF_BACKEND=FLASH_ATTN \
        CHUNK_HALF_RECOMPUTE=4 CHUNK_HALF_CUDAGRAPH=PIECEWISE CHUNK_CACHE_RECOMPUTE_ONE_STEP=1 &&
      ttft chunk 8192 10 TTFT_RECOMPUTE_K=12 TTFT_CUDAGRAPH=PIECEWISE CHUNK_CACHE_RECOMPUTE_ONE_STEP=1 ;;
    remap) python3 benchmarks/gpu_remap.py --sweep quick --sweep-only ;;
    ttft-profile) ttft chunk 32768 3 TTFT_PROFILE=1 ;;
    window-triton) half CHUNK_HALF_MODEL=$M/gpu-window CHUNK_HALF_DTYPES=float16 CHUNK_HALF_BACKEND=TRITON_ATTN CHUNK_HALF_EAGER=1 ;;
    window-fa) half CHUNK_HALF_MODEL=$M/gpu-window CHUNK_HALF_DTYPES=float16 CHUNK_HALF_BACKEND=FLASH_ATTN \
      CHUNK_HALF_EAGER=1 ;;
  esac
}

export -f run_item half ttft

figures() {  # figures ITEM LOG: the lines of the summary that carry the item's figures
  local log=$2
  case $1 in
    k12-1step) grep -oE "chunk-recompute-tokens [0-9]+: .*" "$log" | sort -u | cut -c1-150 | head -2
               figures mla-rows "$log"; figures ttft-rows "$log" ;;
    mla-*|window-*)
      grep -oE "dtype=[a-z0-9]+ eager=.*" "$log" | head -2
      grep -E "^half-precision row: engine=" "$log" | wc -l | sed 's/^/rows printed: /' 
      grep -oE "Chunk cache: (loads use|captures run|[0-9]+ MLA layer).*" "$log" | sort -u | cut -c1-150 | head -3
      grep -o "'cudagraph_mode': <CUDAGraphMode\.[A-Z_]*" "$log" | sort | uniq -c | head -2
      grep -o "Using [A-Z_0-9]* \(attention \)\{0,1\}backend\|Using [A-Za-z_0-9]* MLA prefill backend" "$log" | sort -u | head -2
      grep -E "^E .*(Error|assert)" "$log" | cut -c1-150 | head -2
      grep -E "[0-9]+ (passed|failed|error|skipped)" "$log" | tail -1 ;;
    remap) grep -E "^device|copy:|^sweep|best" "$log" | head -6
           grep -E "^(load|capture) .* False *$" "$log" | head -3 ;;
    ttft-profile) grep -E "Self CPU time total|Self CUDA time total" "$log" | head -2 ;;
    ttft-*) grep -E '^\{' "$log" | cut -c1-200 | head -6
          grep -E "Error" "$log" | tail -1 ;;
  esac
}

after_items() {  # the ratios of the TTFT items close the summary
  say "TTFT ratios (tools/gpu/ttft_ratios.py):"
  python3 tools/gpu/ttft_ratios.py "$LOGS"/ttft-*.log 2>&1 | while IFS= read -r line; do say "  $line"; done
}

source "$(dirname "$0")/harness.sh"
harness_main "$@"
