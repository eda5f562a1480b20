#!/usr/bin/env bash
# NOTE: as run on 2026-11-25; it needs that day's pack layout (.gpu/extra, so2, py2), which
# tools/gpu/pack.sh no longer writes: kept as the record of that run, superseded by issue34.sh.
# On the GPU machine, after the parts are in /tmp/gpu: install, lay this checkout's patched
# sources (.gpu/py2.tar.xz, `./fork apply vllm` then tar of the tree's vllm/) over the
# wheel's, then the sleep check, the GPU-only unit oracles and the bf16 FA exactness row.
set -uo pipefail
bash tools/gpu/install.sh || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/extra/*.whl 2>&1 | grep -v WARN
cp .gpu/so2/vllm/*.so /tmp/site/vllm/
xz -dc .gpu/py2.tar.xz | tar xf - -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
[ -e /tmp/models/.done ] || { python3 tools/gpu/make_models.py /tmp/models >/dev/null 2>&1 && touch /tmp/models/.done; }
for l in 1 2; do python3 tools/gpu/sleep_check.py /tmp/models/gpu-llama $l >"$OUT/sleep$l.log" 2>&1
  echo "sleep $l rc=$?"; grep -E "^level|Error|error:" "$OUT/sleep$l.log" | head -8; done
TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/v1/worker/test_fused_chunk_load.py \
  tests/unit/distributed/test_chunk_cache_fused_chunk_load_path.py tests/unit/distributed/test_chunk_cache_mla_latent_layers.py \
  -k "fp8 or writer_puts_rows" >"$OUT/gpu-unit.log" 2>&1; echo "gpu unit rc=$?"; tail -15 "$OUT/gpu-unit.log"
bash tools/gpu/run_batch.sh half-fa 2>&1 | grep -v "^INFO\|Writing"
