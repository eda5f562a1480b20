#!/usr/bin/env bash
# Packs what a GPU machine without network needs to run this fork (docs/gpu.md, "Next run"):
#   bash tools/gpu/pack.sh        .gpu/part00, .gpu/part01 (vLLM 0.23.0's CUDA extensions and
#                                 vLLM's missing Python dependencies) and .gpu/py.tar.xz
#   bash tools/gpu/pack.sh py     .gpu/py.tar.xz only: the wheel's Python files with this
#                                 checkout's patched sources over them (./fork apply vllm);
#                                 rerun it after any change to vllm/ or patches/
#   bash tools/gpu/pack.sh [py] --dry-run
#                                 print the steps and check the tools they need; runs nothing
# The device tool carries 64 MiB a call, working tree included: each part stays <= 60 MiB.
# Needs Python 3 with pip, unzip, xz, split; nothing else in the system Python: the patched
# sources come from `./fork apply vllm`, which downloads vLLM's sdist through the fork's venv
# (pip runs its setup.py: torch, setuptools-rust), so `./fork setup` runs first (idempotent:
# seconds when the venv exists, ~10 minutes on a fresh machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
only_py=0 dry=0
for a in "$@"; do
  case $a in
    py) only_py=1 ;;
    --dry-run) dry=1 ;;
    *) echo "pack.sh: unknown argument '$a' (py, --dry-run)" >&2; exit 2 ;;
  esac
done
cache=${FORK_CACHE:-.cache}
work=.cache/gpu
if ((dry)); then
  missing=0
  for t in python3 unzip xz split tar; do
    command -v $t >/dev/null || { echo "missing: $t" >&2; missing=1; }
  done
  python3 -m pip --version >/dev/null 2>&1 || { echo "missing: pip for python3" >&2; missing=1; }
  if [ -x "$cache/venv/bin/python" ]; then echo "1. ./fork setup (venv $cache/venv exists: seconds)"
  else echo "1. ./fork setup (no venv at $cache/venv yet: builds it, ~10 minutes)"; fi
  if compgen -G "$work/whl/vllm-0.23.0-*.whl" >/dev/null; then echo "2. vllm 0.23.0 CUDA wheel: cached in $work/whl"
  else echo "2. pip download vllm==0.23.0 (CUDA wheel, 261 MiB) into $work/whl"; fi
  ((only_py)) || echo "3. extensions + dependencies -> .gpu/part00, .gpu/part01 (xz -9e, ~8 minutes)"
  echo "4. ./fork apply vllm --force; the wheel's Python files + $cache/trees/vllm/vllm -> .gpu/py.tar.xz"
  exit $missing
fi
mkdir -p "$work" .gpu
./fork setup
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
 --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64 --platform any"
# NOTE: pip skips a file already in the destination (a previous pack's wheel, 261 MiB).
python3 -m pip download -q --no-deps $plat -d "$work/whl" vllm==0.23.0
wheel=$(ls "$work"/whl/vllm-0.23.0-*.whl)

python_sources() {
  rm -rf "$work/py" && mkdir -p "$work/py"
  (cd "$work/py" && unzip -q "$OLDPWD/$wheel" -x '*.so' 'vllm/vllm-rs' 'vllm/third_party/deep_gemm/*')
  ./fork apply vllm --force
  cp -r "$cache/trees/vllm/vllm/." "$work/py/vllm/"   # the fork's patched sources over the wheel's
  tar cf - -C "$work/py" . | xz -T0 -9 > .gpu/py.tar.xz
  ls -l .gpu/py.tar.xz
}
if ((only_py)); then python_sources; exit 0; fi

# NOTE: the extensions a dense model and MLA need on Hopper (xz -9e sizes in docs/gpu.md):
# _C and _C_stable_libtorch (cuda.py imports both; reshape_and_cache_flash,
# concat_and_cache_mla, rms_norm and rotary_embedding live in the latter), FA3 (FLASH_ATTN,
# FLASH_ATTN_MLA, and the prefill of every MLA backend on SM90), FlashMLA (FLASHMLA),
# cumem_allocator (sleep mode), spinloop. Left out: FA2 (52 MiB, used on Hopper only with
# ALiBi or sinks), _moe_C (37 MiB: no MoE model can run), deep_gemm, vllm-rs.
# So the pack cannot run: FLASHINFER / FLASHINFER_MLA (not carried at all), MoE models,
# ALiBi or attention sinks on Hopper, CUTLASS_MLA and the fp8 DeepGEMM paths.
rm -rf "$work/so" && mkdir -p "$work/so"
(cd "$work/so" && unzip -q "$OLDPWD/$wheel" 'vllm/_C.abi3.so' 'vllm/_C_stable_libtorch.abi3.so' \
  'vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so' 'vllm/_flashmla_C.abi3.so' \
  'vllm/_flashmla_extension_C.abi3.so' 'vllm/spinloop.abi3.so' 'vllm/cumem_allocator.abi3.so')
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
# The wheels unpacked (what `pip install --no-deps --target` would lay down), so that one xz
# stream compresses them all and the device needs no pip.
rm -rf "$work/site" && mkdir -p "$work/site"
for w in "$work"/deps/*.whl; do unzip -q -o "$w" -d "$work/site"; done
# NOTE: data no run here reads: Mistral's tokenizer files (mistral_common is imported, its
# tokenizers are never loaded for Llama/DeepSeek tokenizers), pycountry's translations, tests.
rm -rf "$work"/site/mistral_common/data/tekken_*.json "$work"/site/mistral_common/data/*.model.* \
  "$work/site/pycountry/locales"
find "$work/site" -type d -name tests -prune -exec rm -rf {} +
rm -rf "$work/payload" && mkdir -p "$work/payload"
tar cf - -C "$work/so" . | xz -T2 -9e > "$work/payload/so.tar.xz"
tar cf - -C "$work/site" . | xz -T2 -9e > "$work/payload/deps.tar.xz"
tar cf "$work/payload.tar" -C "$work/payload" .
rm -f .gpu/part*
split -n 2 -d "$work/payload.tar" .gpu/part
python_sources
ls -l "$work/payload" .gpu
for f in .gpu/part*; do
  [ "$(stat -c %s "$f")" -le $((60 << 20)) ] || { echo "$f is over 60 MiB" >&2; exit 1; }
done
