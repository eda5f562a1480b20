#!/usr/bin/env bash
# On the GPU machine: install the CUDA wheel that tools/gpu/pack.sh carried in parts
# (.gpu/part00, part01, ... copied to /tmp/gpu by the calls that carried them, and
# .gpu/MANIFEST, carried by every call). Every part's sha256 is checked against MANIFEST,
# the parts are joined, the wheel's sha256 is checked again (MANIFEST and the payload's
# SHA256SUMS), the dependencies are laid into /tmp/site and the wheel is installed there by
# `pip install --no-index --no-deps`: the device runs what a user installs, nothing laid over.
# (GPU_DIR, STAGE and SITE move .gpu, /tmp/gpu and /tmp/site, for a check on the CPU.)
set -euo pipefail
stage=${STAGE:-/tmp/gpu} site=${SITE:-/tmp/site}
mkdir -p "$stage"
for p in "${GPU_DIR:-.gpu}"/part* "${GPU_DIR:-.gpu}"/MANIFEST; do if [ -e "$p" ]; then cp -u "$p" "$stage/"; fi; done
[ -e "$site/.done" ] && { echo "install: $site already holds $(cat "$site/.done")"; exit 0; }
[ -e "$stage/MANIFEST" ] || { echo "install: $stage/MANIFEST missing (carry .gpu/MANIFEST; docs/gpu.md, Next run)" >&2; exit 3; }
parts=()
while read -r kind name sum; do
  [ "$kind" = part ] || continue
  [ -e "$stage/$name" ] || { echo "install: $stage/$name missing (carry .gpu/$name; docs/gpu.md, Next run)" >&2; exit 3; }
  echo "$sum  $stage/$name" | sha256sum -c --quiet - || { echo "install: $name differs from MANIFEST" >&2; exit 4; }
  parts+=("$stage/$name")
done < "$stage/MANIFEST"
read -r _ wheel wsum < <(grep '^wheel ' "$stage/MANIFEST")
rm -rf "$stage/payload" && mkdir -p "$stage/payload"
cat "${parts[@]}" | tar xf - -C "$stage/payload"
(cd "$stage/payload" && sha256sum -c --quiet SHA256SUMS) || { echo "install: the joined payload fails its SHA256SUMS" >&2; exit 4; }
echo "$wsum  $stage/payload/$wheel" | sha256sum -c --quiet - || { echo "install: $wheel is not the wheel MANIFEST names" >&2; exit 4; }
echo "install: $wheel sha256 $wsum (checked)"
mkdir -p "$site"
xz -T0 -dc "$stage/payload/deps.tar.xz" | tar xf - -C "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
  "$stage/payload/$wheel"
echo "$wheel $wsum" > "$site/.done"
