#!/usr/bin/env bash
# On the GPU machine, the last call of the next run (docs/gpu.md, "Next run (15 minutes of
# device time)"): install, then what the 2026-11-25 run left of issue 34, in priority order,
# each item under `timeout` with its own time box, until the budget is spent.
#
#   bash tools/gpu/issue34.sh [--budget SECONDS] [--only ITEM,...] [--dry-run]
#
# --budget SECONDS (default 480), --only ITEM,... (install always runs), --dry-run (the plan
# only): tools/gpu/harness.sh, which runs the items, says what each does. Writes
# $OUT/summary.txt and $OUT/logs.tar.gz.
set -uo pipefail

SCRIPT=issue34.sh ISSUE="issue 34" LOGS=/tmp/i34 USAGE_LINES=10
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

source "$(dirname "$0")/harness.sh"
harness_main "$@"
