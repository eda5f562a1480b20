#!/usr/bin/env bash
# Packs what a GPU machine without network needs to run this fork (docs/gpu.md, "How it was
# run"): vLLM 0.23.0's CUDA wheel trimmed to a dense model's extensions, vLLM's Python
# dependencies missing from the device image, and this checkout's patched vLLM sources
# (./fork apply vllm). Writes .gpu/partNN (58 MiB each: the device tool carries 64 MiB a call).
set -euo pipefail
cd "$(dirname "$0")/../.."
work=.cache/gpu; mkdir -p "$work" .gpu
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
 --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64 --platform any"
pip download --no-deps $plat -d "$work/whl" vllm==0.23.0
wheel=$(ls "$work"/whl/vllm-0.23.0-*.whl)
# NOTE: vLLM's own requirements minus what the device image already has (torch, triton,
# transformers, numpy, ...) and the CUDA kernel packages a dense model on FLASH_ATTN /
# TRITON_ATTN never imports (flashinfer, tilelang, cutlass-dsl, quack, ...).
pip download $plat -d "$work/deps" blake3 "fastapi[standard]<0.137,>=0.115" "openai>=2" \
  "pydantic>=2.12" "prometheus-fastapi-instrumentator>=7" lm-format-enforcer==0.11.3 \
  outlines_core==0.2.14 diskcache==5.6.3 lark==1.2.2 partial-json-parser pyzmq msgspec \
  "gguf>=0.17" "mistral_common>=1.11.3" python-json-logger pybase64 cbor2 ijson setproctitle \
  "openai-harmony>=0.0.3" "anthropic>=0.71" "model-hosting-container-standards<1,>=0.1.14" mcp \
  opentelemetry-sdk opentelemetry-api opentelemetry-exporter-otlp \
  opentelemetry-semantic-conventions-ai watchfiles cachetools depyf==0.20.0
# NOTE: xgrammar 0.2.8 does not import with vLLM's pinned apache-tvm-ffi 0.1.9; 0.1.15.post2
# (what pip resolves for the CPU venv) works. vLLM imports xgrammar at start-up.
pip download --no-deps $plat -d "$work/deps" compressed-tensors==0.17.0 "xgrammar<1,>=0.2" loguru \
  llguidance==1.6.1 apache-tvm-ffi==0.1.15.post2
for p in numpy pillow protobuf pyyaml regex requests setuptools tqdm typing_extensions urllib3 \
    certifi charset_normalizer idna jinja2 markupsafe packaging pygments rich markdown_it_py \
    mdurl click anyio h11 httpcore-1 httpx-0 attrs tiktoken grpcio uvloop shellingham typer \
    prometheus_client sentry_sdk supervisor googleapis opentelemetry_exporter_otlp_proto_grpc; do
  rm -f "$work"/deps/${p}*.whl
done
rm -rf "$work/so" "$work/py" "$work/payload" && mkdir -p "$work/so" "$work/py" "$work/payload"
(cd "$work/so" && unzip -q "$OLDPWD/$wheel" 'vllm/_C.abi3.so' 'vllm/_C_stable_libtorch.abi3.so' \
  'vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so' 'vllm/_flashmla_C.abi3.so' \
  'vllm/_flashmla_extension_C.abi3.so' 'vllm/spinloop.abi3.so' 'vllm/cumem_allocator.abi3.so')
(cd "$work/py" && unzip -q "$OLDPWD/$wheel" -x '*.so' 'vllm/vllm-rs' 'vllm/third_party/deep_gemm/*')
./fork apply vllm --force
cp -r .cache/trees/vllm/vllm/. "$work/py/vllm/"   # the fork's patched sources over the wheel's
tar cf - -C "$work/so" . | xz -T0 -6 > "$work/payload/so.tar.xz"
tar cf - -C "$work/py" . | xz -T0 -6 > "$work/payload/py.tar.xz"
cp -r "$work/deps" "$work/payload/deps"
rm -f .gpu/part*
tar cf - -C "$work/payload" . | split -b 58M -d - .gpu/part
ls -la .gpu
