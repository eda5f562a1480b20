#!/usr/bin/env bash
# On the GPU machine, from the repository root: one batch of the GPU run (docs/gpu.md).
#   bash tools/gpu/run_batch.sh BATCH      (logs under $OUT)
set -uo pipefail
bash tools/gpu/install.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
export FORK_MODELS=/tmp/models OUT=${OUT:-/tmp/out}
[ -e /tmp/models/.done ] || { python3 tools/gpu/make_models.py /tmp/models && touch /tmp/models/.done; }
M=/tmp/models
half() {  # half NAME ENV...: the half-precision exactness test under the given settings
  local name=$1; shift
  env CHUNK_HALF_MODEL=$M/gpu-llama CHUNK_HALF_GPU_UTIL=0.3 "$@" \
    python3 -m pytest -s -q -p no:cacheprovider tests/e2e/test_chunk_cache_half_precision.py -m "" -k within_3x \
    >"$OUT/half-$name.log" 2>&1
  echo "half $name rc=$?"; grep -E "worst|Chunk cache: (loads|captures)|cudagraph_mode|passed|failed|Error" "$OUT/half-$name.log" | sort -u | head -12
}
case $1 in
  exact)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
    if [ -n "${REMAP:-}" ]; then python3 benchmarks/gpu_remap.py ${REMAP_ARGS:-} >"$OUT/remap.log" 2>&1; echo "remap rc=$?"; tail -25 "$OUT/remap.log"; fi
    half fa CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_EAGER=0
    for l in 1 2; do python3 tools/gpu/sleep_check.py $M/gpu-llama $l >"$OUT/sleep$l.log" 2>&1
      echo "sleep $l rc=$?"; grep -E "^level|Error|error" "$OUT/sleep$l.log" | head -8; done
    half triton CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_EAGER=0 CHUNK_HALF_BACKEND=TRITON_ATTN
    ;;
  exact2)
    half fa-fp16 CHUNK_HALF_DTYPES=float16 CHUNK_HALF_EAGER=0
    half fp8 CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_EAGER=0 CHUNK_HALF_KV_DTYPE=fp8
    CHUNK_HALF_MODEL=$M/gpu-llama CHUNK_HALF_GPU_UTIL=0.3 CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_EAGER=0 \
      python3 tools/gpu/no_fused.py -s -q -p no:cacheprovider tests/e2e/test_chunk_cache_half_precision.py -m "" -k within_3x \
      >"$OUT/half-nofused.log" 2>&1; echo "half nofused rc=$?"
    grep -E "worst|Chunk cache: loads" "$OUT/half-nofused.log" | sort -u | head
    ;;
  half-fa)
    half fa CHUNK_HALF_DTYPES=bfloat16 CHUNK_HALF_EAGER=0
    ;;
  ttft)  # ttft MODE...
    shift
    [ -e $M/llama3-8b/config.json ] || python3 benchmarks/gpu_ttft.py make $M/llama3-8b $M/gpu-llama
    for mode in "$@"; do
      TTFT_PROFILE=1 python3 benchmarks/gpu_ttft.py $mode $M/llama3-8b >"$OUT/ttft-$mode.log" 2>&1
      echo "ttft $mode rc=$?"; grep -E '^\{|Self CUDA time|Error' "$OUT/ttft-$mode.log"
    done
    ;;
esac
