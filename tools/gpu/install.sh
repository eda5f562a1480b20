#!/usr/bin/env bash
# On the GPU machine: assemble the parts that tools/gpu/pack.sh wrote (.gpu/part00 and
# .gpu/part01, copied to /tmp/gpu by the calls that carried them) and lay vLLM's missing
# dependencies, its CUDA extensions and this checkout's patched vLLM (.gpu/py.tar.xz, carried
# by the last call) into /tmp/site. No pip: the dependencies were unpacked by pack.sh.
# (STAGE and SITE move /tmp/gpu and /tmp/site, for a check of the assembly on the CPU.)
set -euo pipefail
stage=${STAGE:-/tmp/gpu} site=${SITE:-/tmp/site}
mkdir -p "$stage"
for p in .gpu/part00 .gpu/part01 .gpu/py.tar.xz; do if [ -e "$p" ]; then cp -u "$p" "$stage/"; fi; done
if [ ! -e "$site/.done" ]; then
  for p in part00 part01 py.tar.xz; do
    [ -e "$stage/$p" ] || { echo "install: $stage/$p missing (carry .gpu/$p; docs/gpu.md, Next run)" >&2; exit 3; }
  done
  mkdir -p "$site" "$stage/payload"
  cat "$stage/part00" "$stage/part01" | tar xf - -C "$stage/payload"
  xz -T0 -dc "$stage/payload/deps.tar.xz" | tar xf - -C "$site"
  xz -T0 -dc "$stage/payload/so.tar.xz" | tar xf - -C "$site"
  xz -T0 -dc "$stage/py.tar.xz" | tar xf - -C "$site"
  touch "$site/.done"
fi
