#!/usr/bin/env bash
# Packs what a GPU machine without network needs to run this fork (docs/gpu.md, "Next run"):
# the user's artifact itself, the CUDA wheel of `./fork build --device cuda`, byte for byte.
#   bash tools/gpu/pack.sh [--base 0.23|0.32]
#       1. ./fork build --device cuda --base B: .cache/dist/vllm-<B>.*+chunkcache.cu<NNN>-*.whl
#          (PyPI's vLLM CUDA wheel with the series and the overlay; docs/building.md);
#       2. vLLM's Python dependencies missing from the device image, unpacked and pruned
#          (deps.tar.xz, ~20 MiB; laid into the site beside the wheel);
#       3. one tar of the wheel and deps.tar.xz, split into .gpu/part00, part01, ... of at
#          most $PART_MIB MiB (58) each, and .gpu/MANIFEST: the wheel's name and sha256, each part's sha256.
#   bash tools/gpu/pack.sh --assemble WHEEL DEPS_TAR_XZ
#       step 3 alone, for these files (GPU_DIR, default .gpu, is where the parts go; PART_BYTES
#       overrides the part size: the CPU test of the assembly uses small parts)
#   bash tools/gpu/pack.sh [--base B] --dry-run
#       print the steps and check the tools; runs nothing; prints the sha256 of the wheel it
#       would carry when that wheel exists.
# On the device, tools/gpu/install.sh reassembles the parts, checks every sha256 and runs
# `pip install --no-deps` of that wheel (the device has no network: the parts are carried,
# one a call, each call carrying the working tree too: 64 MiB in all).
set -euo pipefail
cd "$(dirname "$0")/../.."
base=0.23 dry=0 assemble=()
while [ $# -gt 0 ]; do
  case $1 in
    --assemble) [ $# -ge 3 ] || { echo "pack.sh: --assemble WHEEL DEPS_TAR_XZ" >&2; exit 2; }
      assemble=("$2" "$3"); shift 3 ;;
    --base) base=${2:-}; shift 2 || { echo "pack.sh: --base needs 0.23 or 0.32" >&2; exit 2; } ;;
    --base=*) base=${1#*=}; shift ;;
    --dry-run) dry=1; shift ;;
    *) echo "pack.sh: unknown argument '$1' (--base 0.23|0.32, --dry-run)" >&2; exit 2 ;;
  esac
done
case $base in 0.23|0.32) ;; *) echo "pack.sh: --base takes 0.23 or 0.32, got '$base'" >&2; exit 2 ;; esac
cache=${FORK_CACHE:-.cache}
work=$cache/gpu
# NOTE: a call carries 64 MiB in all, the working tree (4.1 MiB on 2026-11-28) included.
PART_MIB=${PART_MIB:-58}
tree_mib() {  # what travels besides the carried paths: tracked and untracked-not-ignored files
  { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null |
    awk '{s+=$1} END {printf "%.1f", s/1048576}'
}
# NOTE: the name `./fork build --device cuda` gives (vllm-0.23.0+chunkcache.cu129-...whl).
cuda_wheel() { compgen -G "$cache/dist/vllm-$base.*+chunkcache.cu*.whl" | sort | tail -1; }

assemble() {  # assemble WHEEL DEPS_TAR_XZ: one tar (the two and SHA256SUMS), split; MANIFEST
  local wheel=$1 deps=$2 out=${GPU_DIR:-.gpu} bytes=${PART_BYTES:-$((PART_MIB << 20))} f
  rm -rf "$work/payload" && mkdir -p "$work/payload" "$out"
  cp "$wheel" "$work/payload/"
  cp "$deps" "$work/payload/deps.tar.xz"
  (cd "$work/payload" && sha256sum "$(basename "$wheel")" deps.tar.xz > SHA256SUMS)
  tar cf "$work/payload.tar" -C "$work/payload" .
  rm -f "$out"/part* "$out/MANIFEST" "$out/py.tar.xz"
  split -b "$bytes" -d "$work/payload.tar" "$out/part"
  {
    echo "wheel $(basename "$wheel") $(sha256sum "$wheel" | cut -d' ' -f1)"
    for f in "$out"/part*; do echo "part $(basename "$f") $(sha256sum "$f" | cut -d' ' -f1)"; done
  } > "$out/MANIFEST"
  rm -rf "$work/payload" "$work/payload.tar"
  ls -l "$out"
  cat "$out/MANIFEST"
  for f in "$out"/part*; do
    [ "$(stat -c %s "$f")" -le "$bytes" ] || { echo "$f is over $bytes bytes" >&2; exit 1; }
  done
  echo "$(ls "$out"/part* | wc -l) parts; each call carries the working tree ($(tree_mib) MiB) + one part + MANIFEST (64 MiB at most)"
}
if [ ${#assemble[@]} -gt 0 ]; then mkdir -p "$work"; assemble "${assemble[@]}"; exit 0; fi

if ((dry)); then
  missing=0
  for t in python3 xz split tar sha256sum unzip; do
    command -v $t >/dev/null || { echo "missing: $t" >&2; missing=1; }
  done
  python3 -m pip --version >/dev/null 2>&1 || { echo "missing: pip for python3" >&2; missing=1; }
  wheel=$(cuda_wheel || true)
  if [ -n "$wheel" ]; then
    echo "1. ./fork build --device cuda --base $base (rebuilds only if the series or the overlay changed)"
    echo "   wheel: $wheel ($(stat -c %s "$wheel") bytes) sha256 $(sha256sum "$wheel" | cut -d' ' -f1)"
    parts=$(( ($(stat -c %s "$wheel") + (21 << 20) + (PART_MIB << 20) - 1) / (PART_MIB << 20) ))
  else
    echo "1. ./fork build --device cuda --base $base (no CUDA wheel in $cache/dist yet: downloads PyPI's vLLM CUDA wheel, ~260-320 MiB, and builds it)"
    echo "   wheel: none yet, so no sha256"
    parts="5-6"
  fi
  if compgen -G "$work/deps/*.whl" >/dev/null; then echo "2. dependencies: cached in $work/deps"
  else echo "2. pip download of vLLM's missing dependencies into $work/deps (~42 MiB of wheels)"; fi
  echo "3. the wheel + deps.tar.xz -> .gpu/part00.. ($parts parts of <= $PART_MIB MiB) and .gpu/MANIFEST (sha256 of the wheel and of each part)"
  [ "$base" = 0.23 ] || echo "   NOTE: the dependency list was checked against vLLM 0.23's Requires-Dist only"
  tree=$(tree_mib)
  echo "4. one call per part: working tree $tree MiB + a part <= $PART_MIB MiB (+ MANIFEST) of the 64 MiB a call carries"
  awk -v t="$tree" -v p="$PART_MIB" 'BEGIN {exit !(t + p > 63.5)}' &&
    { echo "   the working tree is too large for $PART_MIB MiB parts: PART_MIB=$(awk -v t="$tree" 'BEGIN {printf "%d", 63.5 - t}') bash tools/gpu/pack.sh" >&2; missing=1; }
  exit $missing
fi

mkdir -p "$work" .gpu
./fork build --device cuda --base "$base"
wheel=$(cuda_wheel) || { echo "pack.sh: ./fork build --device cuda wrote no $cache/dist/vllm-$base.*+chunkcache.cu*.whl" >&2; exit 1; }
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
 --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64 --platform any"
# NOTE: vLLM's own requirements minus what the device image already has (torch, triton,
# transformers, numpy, ...) and the CUDA kernel packages a dense model on FLASH_ATTN /
# TRITON_ATTN never imports (flashinfer, tilelang, cutlass-dsl, quack, ...).
python3 -m pip download -q $plat -d "$work/deps" blake3 "fastapi[standard]<0.137,>=0.115" "openai>=2" \
  "pydantic>=2.12" "prometheus-fastapi-instrumentator>=7" lm-format-enforcer==0.11.3 \
  outlines_core==0.2.14 diskcache==5.6.3 lark==1.2.2 partial-json-parser pyzmq msgspec \
  "gguf>=0.17" "mistral_common>=1.11.3" python-json-logger pybase64 cbor2 ijson setproctitle \
  "openai-harmony>=0.0.3" "anthropic>=0.71" "model-hosting-container-standards<1,>=0.1.14" mcp \
  opentelemetry-sdk opentelemetry-api opentelemetry-exporter-otlp \
  opentelemetry-semantic-conventions-ai watchfiles cachetools depyf==0.20.0
# NOTE: xgrammar 0.2.8 does not import with vLLM's pinned apache-tvm-ffi 0.1.9; 0.1.15.post2
# (what pip resolves for the CPU venv) works. vLLM imports xgrammar at start-up.
python3 -m pip download -q --no-deps $plat -d "$work/deps" compressed-tensors==0.17.0 "xgrammar<1,>=0.2" \
  loguru llguidance==1.6.1 apache-tvm-ffi==0.1.15.post2
for p in numpy pillow protobuf pyyaml regex requests setuptools tqdm typing_extensions urllib3 \
    certifi charset_normalizer idna jinja2 markupsafe packaging pygments rich markdown_it_py \
    mdurl click anyio h11 httpcore-1 httpx-0 attrs tiktoken grpcio uvloop shellingham typer \
    prometheus_client sentry_sdk supervisor googleapis opentelemetry_exporter_otlp_proto_grpc \
    apache_tvm_ffi-0.1.9; do
  rm -f "$work"/deps/${p}*.whl
done
# NOTE: the dependencies unpacked (what `pip install --no-deps --target` lays down) and pruned
# of data no run reads (Mistral's tokenizer files, pycountry's translations, tests): 20 MiB
# of xz instead of 42 MiB of wheels, which keeps 0.23's pack at five parts. The vLLM wheel
# itself is carried as it is and installed by pip.
rm -rf "$work/site" && mkdir -p "$work/site"
for w in "$work"/deps/*.whl; do unzip -q -o "$w" -d "$work/site"; done
rm -rf "$work"/site/mistral_common/data/tekken_*.json "$work"/site/mistral_common/data/*.model.* \
  "$work/site/pycountry/locales"
find "$work/site" -type d -name tests -prune -exec rm -rf {} +
tar cf - -C "$work/site" . | xz -T2 -9e > "$work/deps.tar.xz"
assemble "$wheel" "$work/deps.tar.xz"
