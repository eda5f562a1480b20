"""`./fork build --device npu`: what an Ascend user builds and installs, from this machine.

vllm-ascend has no binary wheel for its 0.23.0.post1 release on PyPI (only its sdist): its
custom kernels are compiled with CANN on the Ascend machine. So the fork's Ascend artifacts,
written to .cache/dist/npu/, are:
- the patched vllm-ascend source distribution: the pinned sdist's members byte for byte,
  except the files its series patches, the overlay's new files, and the version (PKG-INFO,
  `+chunkcache`); the user builds it with CANN (`ascend_commands`);
- the patched vLLM as vLLM's own `VLLM_TARGET_DEVICE=empty` build (Python only: vllm-ascend
  supplies the device code) of the pinned sdist + series + overlay, relabelled
  `+chunkcache.empty`, tagged py3-none-any (it holds no compiled file; Ascend hosts are
  often aarch64), with the overlay files setuptools does not package added.
Trees are materialised under .cache/npu/, never in .cache/trees* (the workflow's trees).
No CANN, no NPU: nothing here compiles or runs NPU code (docs/ascend.md).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import shutil
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import bases, fetch, wheel
from .paths import Paths
from .pins import load_pins
from .progress import ToolError, run, say, step
from .series import apply_series, load_patches
from .tree import overlay_files
from .wheel import _record_hash, write_record

# Local version labels: the vllm-ascend sdist is `<version>+chunkcache`; the vLLM wheel
# `<version>+chunkcache.empty` (upstream's empty build is `<version>+empty`).
ASCEND_LABEL = "chunkcache"
VLLM_LABEL = "chunkcache.empty"
# A SoC for the metadata step of pip only (vllm-ascend's setup.py refuses to run without
# one); the user's build names their own (`ascend_commands`).
METADATA_SOC = fetch.SDIST_ENV["vllm-ascend"]["SOC_VERSION"]
# Settings of vLLM's setup.py that would change what the empty build makes: a version
# override (also rewrites vllm/_version.py, see _check_raw_wheel), precompiled binaries,
# a required Rust frontend.
CLEARED_BUILD_ENV = ("VLLM_VERSION_OVERRIDE", "SETUPTOOLS_SCM_PRETEND_VERSION",
                     "SETUPTOOLS_SCM_PRETEND_VERSION_FOR_VLLM", "VLLM_USE_PRECOMPILED",
                     "VLLM_USE_PRECOMPILED_RUST", "VLLM_REQUIRE_RUST_FRONTEND",
                     "VLLM_MAIN_CUDA_VERSION")
# A deterministic mtime for the members this tool writes into the sdist.
NEW_MEMBER_MTIME = 946684800  # 2000-01-01


@dataclass(frozen=True)
class NpuArtifacts:
    # The patched vllm-ascend sdist (build it on the Ascend machine with CANN).
    ascend_sdist: Path
    # vLLM's empty-target wheel of the patched vLLM sdist (pure Python).
    vllm_wheel: Path
    ascend_version: str
    vllm_version: str


def _version(paths: Paths, tree: str) -> str:
    return load_pins(paths.pins_file)[bases.pin_name(paths, tree, "sdist")].version


def artifacts(paths: Paths) -> NpuArtifacts:
    """Where build() writes, by name (they exist only after it ran)."""
    av, vv = _version(paths, "vllm-ascend"), _version(paths, "vllm")
    ascend_version, vllm_version = f"{av}+{ASCEND_LABEL}", f"{vv}+{VLLM_LABEL}"
    out = paths.dist / "npu"
    return NpuArtifacts(ascend_sdist=out / f"vllm_ascend-{ascend_version}.tar.gz",
                        vllm_wheel=out / f"vllm-{vllm_version}-py3-none-any.whl",
                        ascend_version=ascend_version, vllm_version=vllm_version)


def ascend_commands(art: NpuArtifacts) -> str:
    """The upstream commands an Ascend user runs on a CANN machine (docs/ascend.md).

    NOTE: vllm-ascend's own recipe (its Dockerfile and docs/source/installation.md,
    "Build from source code"), with the two files in place of its git checkouts."""
    return f"""\
# On the Ascend machine: CANN toolkit, its kernels package and NNAL installed (vllm-ascend's
# docs/source/installation.md), gcc/g++ > 8 and cmake; both files copied there.
source /usr/local/Ascend/ascend-toolkit/set_env.sh
source /usr/local/Ascend/nnal/atb/set_env.sh
export PIP_EXTRA_INDEX_URL=https://mirrors.huaweicloud.com/ascend/repos/pypi  # torch-npu, triton-ascend
pip install {art.vllm_wheel.name} --extra-index-url https://download.pytorch.org/whl/cpu/
export SOC_VERSION=ascend910b1   # only where npu-smi is absent (else detected): A2 ascend910b1,
                                 #   A3 ascend910_9391, 300I DUO ascend310p1, 950DT ascend950dt_9582
export COMPILE_CUSTOM_KERNELS=1  # vllm-ascend's default: compile its kernels with CANN
pip install {art.ascend_sdist.name} --extra-index-url https://download.pytorch.org/whl/cpu/
pip uninstall -y triton triton-ascend && pip install triton-ascend==3.2.2
vllm serve MODEL --enable-chunk-cache"""


def inputs_digest(paths: Paths, sources: list[Path]) -> str:
    h = hashlib.sha256()
    # wheel.py: the fork's requirements (FORK_REQUIREMENTS) the vLLM wheel declares.
    for f in [Path(__file__), Path(wheel.__file__),
              *sorted(paths.patches_dir("vllm").glob("*")),
              *sorted(paths.patches_dir("vllm-ascend").glob("*"))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    for tree in ("vllm", "vllm-ascend"):
        for rel, f in overlay_files(paths, tree).items():
            h.update(rel.encode() + b"\0" + f.read_bytes())
    for s in sources:
        h.update(s.name.encode())
    return h.hexdigest()


def changed_files(paths: Paths, base: bases.Base) -> dict[str, bytes | None]:
    """Tree path -> content after the series (None: deleted), and every overlay file.

    NOTE: the same rules as `./fork apply` and the CPU wheel: the series applies strictly,
    and an overlay file may not replace an upstream one (that is a patch)."""
    patches = load_patches(paths.patches_dir(base.tree))
    touched = {p for patch in patches for p in patch.touched_paths()}
    result = apply_series(base.read_files(touched), patches)
    if result.failed is not None:
        raise ToolError(f"{result.failed.name} does not apply to {base.label()}:\n"
                        f"{result.problem}")
    out = dict(result.files)
    overlay = overlay_files(paths, base.tree)
    clash = sorted(base.read_files(set(overlay)))
    if clash:
        raise ToolError(f"overlay files replace upstream files (make them patches): {clash}")
    out.update({rel: f.read_bytes() for rel, f in overlay.items()})
    return out


def materialise(base: bases.Base, changed: dict[str, bytes | None], dest: Path) -> Path:
    """A plain directory (no git) of `base` with `changed` (changed_files), replacing `dest`.

    NOTE: not tree.apply's git repository: vLLM's setup.py takes its version from
    setuptools_scm, which in a git checkout without release tags makes a dev version
    (0.1.devN); in a plain directory it reads the sdist's PKG-INFO (the release)."""
    changed = dict(changed)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name, data in base.iter_files():
        if name in changed:
            data = changed.pop(name)
            if data is None:
                continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(data)
    for name, data in changed.items():
        if data is not None:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(data)
    return dest


def _set_version(text: str, version: str) -> str:
    new, n = re.subn(r"^Version: .*$", f"Version: {version}", text, count=1, flags=re.M)
    if n != 1:
        raise ToolError("no 'Version:' line in the sdist's PKG-INFO")
    return new


def patched_sdist(paths: Paths, base: bases.Base, version: str, out: Path) -> Path:
    """The pinned sdist with the series and overlay applied, as a new sdist `out`.

    Members are copied byte for byte (mode, mtime) except the patched ones; the overlay's
    files are added (and listed in the egg-info's SOURCES.txt, which setuptools reads as the
    manifest when it builds from an unpacked sdist); PKG-INFO carries `version`, which
    vllm-ascend's setup.py reads back through setuptools_scm's PKG-INFO fallback."""
    changed = changed_files(paths, base)
    top = out.name.removesuffix(".tar.gz")
    tmp = out.with_name(out.name + ".tmp")
    new_files = sorted(rel for rel, data in changed.items() if data is not None)
    with tarfile.open(base.path, "r:gz") as src, open(tmp, "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as dst:
        old_top = None
        for m in src:
            first, _, rel = m.name.partition("/")
            if old_top is None:
                old_top = first
            elif first != old_top:
                raise ToolError(f"{base.path.name}: more than one top-level folder")
            info = tarfile.TarInfo(f"{top}/{rel}" if rel else top)
            for attr in ("mode", "mtime", "type", "linkname", "uid", "gid"):
                setattr(info, attr, getattr(m, attr))
            if not m.isfile():
                dst.addfile(info)
                continue
            data = src.extractfile(m).read()
            if rel in changed:
                data = changed[rel]
                if data is None:
                    continue
                new_files.remove(rel)
            elif rel == "PKG-INFO" or rel.endswith(".egg-info/PKG-INFO"):
                data = _set_version(data.decode(), version).encode()
            elif rel.endswith(".egg-info/SOURCES.txt"):
                listed = set(data.decode().splitlines())
                listed |= {r for r, d in changed.items() if d is not None}
                listed -= {r for r, d in changed.items() if d is None}
                data = "".join(f"{f}\n" for f in sorted(listed)).encode()
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
        for rel in new_files:
            data = changed[rel]
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size, info.mode, info.mtime = len(data), 0o644, NEW_MEMBER_MTIME
            dst.addfile(info, io.BytesIO(data))
    os.replace(tmp, out)
    return out


def _no_rust_dir(work: Path) -> Path:
    """A folder holding a `rustc` that fails, put first on PATH for vLLM's build.

    NOTE: vLLM 0.23.0's setup.py declares its Rust frontend (`vllm-rs`) as an optional
    setuptools-rust extension (required only with VLLM_REQUIRE_RUST_FRONTEND): where rustc
    answers it compiles it (crates from the network, many minutes), where it does not it
    leaves it out. The empty build leaves it out here whatever the machine has, so the
    wheel is pure Python; vLLM runs it only with VLLM_RUST_FRONTEND_PATH set."""
    shim = work / "no-rust"
    shim.mkdir(parents=True, exist_ok=True)
    rustc = shim / "rustc"
    rustc.write_text("#!/bin/sh\necho 'rustc hidden by ./fork build --device npu' >&2\nexit 1\n")
    rustc.chmod(0o755)
    return shim


def build_empty_wheel(paths: Paths, python: Path, tree: Path, work: Path) -> Path:
    """vLLM's own `VLLM_TARGET_DEVICE=empty` build of `tree` (pip, no build isolation)."""
    raw = work / "raw-wheel"
    shutil.rmtree(raw, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_BUILD_ENV}
    env.update(VLLM_TARGET_DEVICE="empty",
               PATH=f"{_no_rust_dir(work)}{os.pathsep}{env.get('PATH', '')}")
    # NOTE: the fork's venv holds every build requirement the empty target uses (torch,
    # setuptools, setuptools-scm, setuptools-rust, packaging); cmake/ninja are for the
    # device targets only. No isolation and no index: nothing is downloaded.
    run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-w", raw, tree], env=env, quiet=True)
    wheels = list(raw.glob("vllm-*.whl"))
    if len(wheels) != 1:
        raise ToolError(f"pip wheel made {[w.name for w in wheels]} in {raw}, not one vllm wheel")
    return wheels[0]


def _check_raw_wheel(names: list[str], read, upstream_version: str) -> str:
    """The empty build's dist-info folder; refuses a wheel this tool must not relabel."""
    compiled = [n for n in names if n.endswith((".so", ".pyd")) or n.endswith("/vllm-rs")]
    if compiled:
        raise ToolError(f"the empty-target vLLM wheel holds compiled files {compiled[:5]}: "
                        "it cannot be tagged py3-none-any")
    infos = {n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")}
    expected = f"vllm-{upstream_version}+empty.dist-info"
    if infos != {expected}:
        raise ToolError(f"the empty-target build made {sorted(infos)}, expected {expected}")
    # NOTE: vllm-ascend picks code paths with vllm_version_is("0.23.0"), i.e.
    # Version(vllm.__version__) == Version("0.23.0"): a local label in vllm/_version.py
    # (what VLLM_VERSION_OVERRIDE would write) takes every other branch. Only the
    # distribution's metadata carries the fork's label.
    line = f"__version__ = version = '{upstream_version}'"
    if line not in read("vllm/_version.py").decode():
        raise ToolError(f"vllm/_version.py of the empty build does not say {line!r}")
    return expected


def _with_requirements(metadata: str, added: tuple[str, ...]) -> str:
    """METADATA with a `Requires-Dist` line for each of `added` at the end of its headers."""
    header, sep, body = metadata.partition("\n\n")
    lines = "".join(f"\nRequires-Dist: {r}" for r in added)
    return header.rstrip("\n") + lines + "\n" + (sep[1:] + body if sep else "")


def relabel_wheel(raw: Path, out: Path, upstream_version: str, version: str,
                  overlay: dict[str, bytes] | None = None) -> Path:
    """`raw` (vLLM's empty build) as `out`: version `version`, tag py3-none-any.

    Every member is copied byte for byte but METADATA's Version and its requirements (the
    fork's own, wheel.FORK_REQUIREMENTS: neither vLLM nor vllm-ascend requires xxhash),
    WHEEL's tag lines and RECORD (rewritten); the dist-info folder is renamed. The `overlay`
    files the build left out are added.

    NOTE: setuptools packages a package's .py files and its declared package_data only, so
    an overlay file of another kind would not be in vLLM's own build; the wheel carries the
    whole overlay, as the CPU wheel does."""
    tmp = out.with_name(out.name + ".tmp")
    new_info = f"vllm-{version}.dist-info"
    records: list[list[str]] = []
    with zipfile.ZipFile(raw) as src, \
            zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as dst:
        old_info = _check_raw_wheel(src.namelist(), src.read, upstream_version)
        names = set(src.namelist())
        for rel, data in sorted((overlay or {}).items()):
            if rel in names:
                if src.read(rel) != data:
                    raise ToolError(f"the empty build's {rel} differs from the overlay's")
                continue
            zi = zipfile.ZipInfo(rel, date_time=(2000, 1, 1, 0, 0, 0))
            zi.external_attr, zi.compress_type = 0o644 << 16, zipfile.ZIP_DEFLATED
            dst.writestr(zi, data)
            records.append([rel, _record_hash(data), str(len(data))])
        for info in src.infolist():
            name = info.filename
            if info.is_dir() or name == f"{old_info}/RECORD":
                continue
            data = src.read(name)
            if name == f"{old_info}/METADATA":
                data = _with_requirements(_set_version(data.decode(), version),
                                          wheel.FORK_REQUIREMENTS).encode()
            elif name == f"{old_info}/WHEEL":
                text = re.sub(r"^Root-Is-Purelib: .*$", "Root-Is-Purelib: true", data.decode(),
                              flags=re.M)
                text = re.sub(r"^Tag: .*\n", "", text, flags=re.M)
                data = (text.rstrip("\n") + "\nTag: py3-none-any\n\n").encode()
            new_name = name.replace(old_info + "/", new_info + "/", 1)
            zi = zipfile.ZipInfo(new_name, date_time=info.date_time)
            zi.external_attr, zi.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            dst.writestr(zi, data)
            records.append([new_name, _record_hash(data), str(len(data))])
        write_record(dst, new_info, records)
    os.replace(tmp, out)
    return out


def _python(paths: Paths) -> Path:
    py = paths.venv_python()
    if not py.exists():
        raise ToolError("the vLLM build (and the sdists' download) runs vLLM's setup.py, "
                        "which needs the fork's venv (torch, setuptools-scm, setuptools-rust): "
                        f"run `./fork setup --base {paths.base.name}` first")
    return py


def build(paths: Paths) -> list[Path]:
    """Both Ascend artifacts under .cache/dist/npu/ (rebuilt only when an input changed);
    prints the commands that build and install them on an Ascend machine."""
    if "vllm-ascend" not in paths.base.trees:
        raise ToolError(f"--device npu: vllm-ascend has no release for vLLM "
                        f"{paths.base.name}; its 0.23.0.post1 pins vLLM 0.23 (--base 0.23)")
    python = _python(paths)
    pins = [bases.pin_name(paths, tree, "sdist") for tree in ("vllm", "vllm-ascend")]
    fetch.fetch(paths, pins, python=python)
    vllm_base = bases.base_for(paths, "vllm", "sdist")
    ascend_base = bases.base_for(paths, "vllm-ascend", "sdist")
    art = artifacts(paths)
    out = art.ascend_sdist.parent
    stamp = out / ".inputs"
    digest = inputs_digest(paths, [vllm_base.path, ascend_base.path])
    done = [art.ascend_sdist, art.vllm_wheel]
    if all(p.exists() for p in done) and stamp.exists() and stamp.read_text() == digest:
        say(f"{out}: up to date")
    else:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        work = paths.cache / "npu"
        with step(f"writing {art.ascend_sdist.name} (vllm-ascend sdist + series + overlay)"):
            patched_sdist(paths, ascend_base, art.ascend_version, art.ascend_sdist)
        # NOTE: one read of the series' results and the overlay for the tree and the
        # files added to the wheel (the repository may change while pip runs).
        changed = changed_files(paths, vllm_base)
        with step(f"materialising vLLM {vllm_base.path.name} + series + overlay in {work}"):
            tree = materialise(vllm_base, changed, work / "vllm")
        with step("building vLLM with VLLM_TARGET_DEVICE=empty (its setup.py, pip wheel)"):
            raw = build_empty_wheel(paths, python, tree, work)
        relabel_wheel(raw, art.vllm_wheel, _version(paths, "vllm"), art.vllm_version,
                      {rel: changed[rel] for rel in overlay_files(paths, "vllm")
                       if changed.get(rel) is not None})
        stamp.write_text(digest)
        # NOTE: the materialised tree (~130 MB) is scratch: CI machines are short of disk.
        shutil.rmtree(work)
    for p in done:
        say(f"{p} ({p.stat().st_size / 1e6:.1f} MB)")
    say("not built or run here: vllm-ascend's CANN build and anything on an NPU. "
        "On an Ascend machine:")
    print(ascend_commands(art), file=sys.stderr, flush=True)
    return done
