# Item helpers shared by issue40.sh's and issue60.sh's run_item (sourced by them; called at
# run time from the repository root, with $M set by harness.sh's harness_main).
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

