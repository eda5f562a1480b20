#!/usr/bin/env bash
# On the GPU machine: install the CUDA wheel that tools/gpu/pack.sh carried in parts
# (.gpu/part00, part01, ... copied to /tmp/gpu by the calls that carried them, and
# .gpu/MANIFEST, carried by every call). Every part's sha256 is checked against MANIFEST,
# the parts are joined, the wheel's sha256 is checked again (MANIFEST and the payload's
# SHA256SUMS), the dependencies are laid into /tmp/site and the wheel is installed there by
# `pip install --no-index --no-deps`: the device runs what a user installs, nothing laid over.
# A site whose .done names MANIFEST's wheel and sha256 is kept; any other is reinstalled.
# (GPU_DIR, STAGE and SITE move .gpu, /tmp/gpu and /tmp/site, for a check on the CPU.)
set -euo pipefail
stage=${STAGE:-/tmp/gpu} site=${SITE:-/tmp/site}
mkdir -p "$stage"
# A carried file always replaces the staged one: a warm machine's stage may hold an older
# wheel's parts and MANIFEST under the same names.
for p in "${GPU_DIR:-.gpu}"/part* "${GPU_DIR:-.gpu}"/MANIFEST; do if [ -e "$p" ]; then cp -f "$p" "$stage/"; fi; done
[ -e "$stage/MANIFEST" ] || { echo "install: $stage/MANIFEST missing (carry .gpu/MANIFEST; docs/gpu.md, Next run)" >&2; exit 3; }
read -r _ wheel wsum < <(grep '^wheel ' "$stage/MANIFEST")
# Done only if the site holds the wheel MANIFEST names (name and sha256); an earlier
# wheel's site is removed and installed afresh.
if [ -e "$site/.done" ]; then
  if [ "$(cat "$site/.done")" = "$wheel $wsum" ]; then echo "install: $site already holds $wheel $wsum"; exit 0; fi
  echo "install: $site holds $(cat "$site/.done"), not MANIFEST's $wheel $wsum: reinstalling"
  rm -rf "$site"
fi
parts=()
while read -r kind name sum; do
  [ "$kind" = part ] || continue
  [ -e "$stage/$name" ] || { echo "install: $stage/$name missing (carry .gpu/$name; docs/gpu.md, Next run)" >&2; exit 3; }
  echo "$sum  $stage/$name" | sha256sum -c --quiet - || { echo "install: $name differs from MANIFEST" >&2; exit 4; }
  parts+=("$stage/$name")
done < "$stage/MANIFEST"
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
