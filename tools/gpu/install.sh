#!/usr/bin/env bash
# On the GPU machine: assemble the parts that tools/gpu/pack.sh wrote (copied to /tmp/gpu by
# earlier calls), install vLLM's missing dependencies and the fork's vLLM into /tmp/site.
set -euo pipefail
cd /tmp/gpu
if [ ! -e /tmp/site/.done ]; then
  cat part* | tar xf -
  mkdir -p /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site deps/*.whl
  xz -dc py.tar.xz | tar xf - -C /tmp/site
  xz -dc so.tar.xz | tar xf - -C /tmp/site
  touch /tmp/site/.done
fi
