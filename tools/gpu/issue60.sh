#!/usr/bin/env bash
# On the GPU machine, the last call of the next run (docs/gpu.md, "Next run"): install the
# user's CUDA wheel (tools/gpu/install.sh: the parts pack.sh wrote, sha256-checked, `pip
# install --no-deps`), then in issue 59's and 60's priority order, each item under `timeout`
# with its own time box, until the budget is spent:
#   1. serve: `vllm serve` gpu-llama with --enable-chunk-cache and a documents request
#      (prompt_segments) and the same documents reordered, checked (tools/gpu/serve_check.py);
#   2. profile, profile-b128: every millisecond of the 8k and 32k all-hit request and of its
#      floor on one engine (tools/gpu/phase_clock.py), 16-token then 128-token blocks;
#   3. ttft-8k, ttft-32k: all-hit with its floor, stock and APC-same, engines sized per size;
#   4. k12-1step: sink vs sink+K12 at 8k on the one-step path (CHUNK_CACHE_RECOMPUTE_ONE_STEP=1);
#   5. exact-*: the one-step path's exactness in bf16 and fp16 on FLASH_ATTN and TRITON_ATTN,
#      vLLM's default graph mode. Every ratio is printed beside its target.
#
#   bash tools/gpu/issue60.sh [--budget SECONDS] [--only ITEM,...] [--dry-run]
#
# --budget SECONDS (default 480), --only ITEM,... (install always runs; also orders),
# --dry-run (the plan only): tools/gpu/harness.sh runs the items. Writes $OUT/summary.txt,
# $OUT/logs.tar.gz and $OUT/traces.tar (the profiler traces, gzip'd chrome JSON).
set -uo pipefail

SCRIPT=issue60.sh ISSUE="issues 59 and 60" LOGS=/tmp/i60 USAGE_LINES=20
ITEMS=(  # name  box(s)  min(s)  what (priority order)
  "serve 150 90 install check: vllm serve gpu-llama --enable-chunk-cache, one documents request and the same documents reordered"
  "profile 240 150 phase clocks of all-hit and floor at 8k and 32k, one engine, 16-token blocks, CUDA events, traces"
  "profile-b128 220 140 the same with 128-token blocks (the A/B)"
  "ttft-8k 240 160 TTFT at 8k: all-hit + floor, stock, APC-same (three engines sized for 8k)"
  "ttft-32k 270 180 TTFT at 32k: all-hit + floor, stock, APC-same (three engines sized for 32k)"
  "k12-1step 160 110 sink vs sink+K12 at 8k on the one-step path, vLLM's default graph mode"
  "exact-bf16-fa 170 120 one-step exactness: gpu-llama bf16 FLASH_ATTN K=4, default graph mode, vs HF within 3x of stock"
  "exact-fp16-fa 170 120 the same in fp16 on FLASH_ATTN"
  "exact-bf16-triton 170 120 the same in bf16 on TRITON_ATTN"
  "exact-fp16-triton 170 120 the same in fp16 on TRITON_ATTN"
)

source "$(dirname "$0")/items.sh"  # half, ttft
per_size() {  # per_size SIZE: all-hit + floor, stock, APC-same; each engine in its own process
  ttft chunk "$1" 10; ttft stock "$1" 5; ttft apc "$1" 10
}
one_step() {  # one_step DTYPE BACKEND: exactness of the one-step path, default graph mode
  half CHUNK_HALF_MODEL=$M/gpu-llama CHUNK_HALF_DTYPES=$1 CHUNK_HALF_BACKEND=$2 \
    CHUNK_HALF_RECOMPUTE=4 CHUNK_CACHE_RECOMPUTE_ONE_STEP=1
}
phases() {  # phases [ARGS...]: tools/gpu/phase_clock.py at 8k and 32k, traces kept
  python3 tools/gpu/phase_clock.py $M/llama3-8b --sizes 8192,32768 --reps 10 \
    --gpu-memory-utilization 0.85 --trace-dir /tmp/i60-traces --trace-sizes 32768 "$@"
}

run_item() {  # the command of one item; its output goes to the item's log
  case $1 in
    serve) python3 tools/gpu/serve_check.py $M/gpu-llama --log "$LOGS/serve-server.log" -- \
      --dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.3 ;;
    profile) phases ;;
    profile-b128) phases --block-size 128 ;;
    ttft-8k) per_size 8192 ;;
    ttft-32k) per_size 32768 ;;
    k12-1step) ttft chunk 8192 10 TTFT_RECOMPUTE_K=12 CHUNK_CACHE_RECOMPUTE_ONE_STEP=1 ;;
    exact-bf16-fa) one_step bfloat16 FLASH_ATTN ;;
    exact-fp16-fa) one_step float16 FLASH_ATTN ;;
    exact-bf16-triton) one_step bfloat16 TRITON_ATTN ;;
    exact-fp16-triton) one_step float16 TRITON_ATTN ;;
  esac
}

export -f run_item half ttft per_size one_step phases
export LOGS

figures() {  # figures ITEM LOG: the lines of the summary that carry the item's figures
  local log=$2
  case $1 in
    serve) grep -E "^serve-check: (server up|documents|PASS|FAIL)|^server: " "$log" | cut -c1-190 | head -6 ;;
    profile*) grep -E "^(above the floor|counts|trace) " "$log" | cut -c1-190 | head -12
              grep -E "Error|phase_clock:" "$log" | tail -2 ;;
    exact-*)
      grep -oE "every head and the question in one step on .*" "$log" | sort -u | cut -c1-150 | head -1
      grep -oE "dtype=[a-z0-9]+ eager=.*" "$log" | tail -1
      grep -o "'cudagraph_mode': <CUDAGraphMode\.[A-Z_]*" "$log" | sort | uniq -c | head -2
      grep -E "^E .*(Error|assert)" "$log" | cut -c1-150 | head -2
      grep -E "[0-9]+ (passed|failed|error|skipped)" "$log" | tail -1 ;;
    ttft-*|k12-1step)
      grep -oE "every head and the question in one step on .*" "$log" | sort -u | cut -c1-150 | head -1
      grep -E '^\{' "$log" | grep -v start_up_s | cut -c1-200 | head -6
      grep -E "Error" "$log" | tail -1 ;;
  esac
}

after_items() {  # the ratios against their targets close the summary; the traces travel
  say "TTFT ratios against issue 60's targets (tools/gpu/ttft_ratios.py):"
  python3 tools/gpu/ttft_ratios.py "$LOGS"/ttft-*.log "$LOGS"/k12-1step.log 2>&1 |
    while IFS= read -r line; do say "  $line"; done
  if [ -d /tmp/i60-traces ]; then tar cf "$OUT/traces.tar" -C /tmp/i60-traces .; fi
}

source "$(dirname "$0")/harness.sh"
harness_main "$@"
