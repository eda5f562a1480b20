"""The CUDA wheels (`./fork build --device cuda`, both bases) against PyPI's vLLM CUDA
wheels they are built from, without a GPU. The `cuda_wheel` tier (pytest.ini: deselected
by default) downloads from PyPI, which `./fork test`'s pytest cannot reach (it runs in a
network namespace with only loopback): it runs as plain pytest in a fork venv after
`./fork setup`, `.cache/venv/bin/python -m pytest -m cuda_wheel
tests/tools/test_cuda_wheel.py`, as .ci/run's stage does where it fits. Each base
downloads ~0.3 GB of vLLM wheel (+0.5 GB of torch for 0.32), and the install test lays
down a venv of ~9 GB (8.9 GB measured for 0.23: the CUDA wheel's requirements, NVIDIA
libraries included), removed after.

1. Member by member: every member of upstream's wheel is in the built wheel with
   identical bytes, unless the series names it (then its bytes are what `git apply` of
   the series makes of upstream's file, applied here patch by patch without forktool) or
   it is METADATA (which may differ in the Version line only) or RECORD (rewritten:
   every entry's sha256 and size are the built member's, and every member is listed).
   The only members upstream lacks are the overlay's files, byte for byte the
   repository's `vllm/`.
2. Installed with pip into a new venv (with its dependencies, next to the torch CUDA
   build it requires), `import vllm`, the chunk cache's config and its connector import
   on this CPU-only machine. What cannot run without an NVIDIA driver is named below and
   asserted to fail for that reason.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from forktool import fetch, wheel
from forktool.paths import Paths
from forktool.pins import load_pins
from forktool.releases import RELEASES
from forktool.series import load_patches
from forktool.tree import overlay_files

pytestmark = pytest.mark.cuda_wheel

BASES = sorted(RELEASES)
CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.connector"


@pytest.fixture(scope="module", params=BASES)
def built(request) -> tuple[Paths, Path, Path]:
    """(paths, upstream CUDA wheel, built wheel) of one base; downloads and builds as a
    user would (`./fork build --device cuda --base B`)."""
    paths = Paths.default(request.param, "cuda")
    t0 = time.monotonic()
    files = fetch.fetch(paths, wheel.upstream_pins(paths, "cuda"))
    out = wheel.build_wheel(paths, "cuda").path
    print(
        f"\n[cuda_wheel] {request.param}: fetch + build {time.monotonic() - t0:.0f} s, "
        f"{out.name} {out.stat().st_size / 1e6:.0f} MB"
    )
    return paths, files[paths.base.cuda.wheel_pin], out


def _git_apply_series(
    paths: Paths, upstream: zipfile.ZipFile, tmp: Path
) -> dict[str, bytes]:
    """The series applied with plain `git apply` (outside any repository), patch by
    patch, to upstream's files it names: the oracle for the patched members."""
    patch_dir = paths.patches_dir("vllm")
    names = [
        line.strip()
        for line in (patch_dir / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    touched = {p for patch in load_patches(patch_dir) for p in patch.touched_paths()}
    root = tmp / "tree"
    for rel in touched:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(upstream.read(rel))
    for name in names:
        done = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", str(patch_dir / name)],
            cwd=root,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"{name}: {done.stderr}"
    return {rel: (root / rel).read_bytes() for rel in touched}


def test_members_are_upstreams_bytes_but_the_series_and_the_overlay(built, tmp_path):
    paths, upstream_path, built_path = built
    version = load_pins(paths.pins_file)[paths.base.cuda.wheel_pin].version
    old_info = f"vllm-{version}.dist-info"
    with zipfile.ZipFile(upstream_path) as up, zipfile.ZipFile(built_path) as ours:
        got = {i.filename: i for i in ours.infolist()}
        new_info = next(
            n.split("/")[0] for n in got if n.endswith(".dist-info/METADATA")
        )
        assert new_info == f"vllm-{version}+chunkcache.cu130.dist-info"
        patched = _git_apply_series(paths, up, tmp_path)
        overlay = {
            rel: f.read_bytes() for rel, f in overlay_files(paths, "vllm").items()
        }
        seen, identical, by_series = set(), 0, 0
        for info in up.infolist():
            if info.is_dir():
                continue
            name = info.filename.replace(old_info + "/", new_info + "/", 1)
            assert name in got, f"{info.filename} missing from the built wheel"
            seen.add(name)
            data = ours.read(name)
            if info.filename in patched:
                assert data == patched[info.filename], f"{name}: not the series' result"
                assert data != up.read(info.filename), (
                    f"{name}: the series changed nothing"
                )
                by_series += 1
            elif info.filename == f"{old_info}/METADATA":
                a, b = up.read(info.filename).decode(), data.decode()
                # The version is labelled and the overlay's own requirement (xxhash)
                # added before upstream's first: nothing else changes.
                first = a.index("Requires-Dist: ")
                want = (a[:first] + "Requires-Dist: xxhash\n" + a[first:]).replace(
                    f"\nVersion: {version}\n",
                    f"\nVersion: {version}+chunkcache.cu130\n",
                    1,
                )
                assert b == want
            elif info.filename == f"{old_info}/RECORD":
                continue
            else:
                assert data == up.read(info.filename), (
                    f"{name}: bytes differ from upstream"
                )
                identical += 1
        # Every patched file is a member of the wheel (a file the series names but the
        # wheel lacks would be silently unpatched).
        assert set(patched) <= {i.filename for i in up.infolist()}
        extra = set(got) - seen
        assert extra == set(overlay), (
            f"members upstream lacks, not the overlay: "
            f"{sorted(extra ^ set(overlay))[:10]}"
        )
        for rel, data in overlay.items():
            assert ours.read(rel) == data, rel
        rows = list(csv.reader(io.StringIO(ours.read(f"{new_info}/RECORD").decode())))
        assert sorted(r[0] for r in rows) == sorted(got)
        for name, digest, size in rows:
            if name == f"{new_info}/RECORD":
                assert (digest, size) == ("", "")
                continue
            data = ours.read(name)
            want = (
                base64.urlsafe_b64encode(hashlib.sha256(data).digest())
                .rstrip(b"=")
                .decode()
            )
            assert (digest, size) == (f"sha256={want}", str(len(data))), name
    print(
        f"[cuda_wheel] {paths.base.name}: {identical} members identical, "
        f"{by_series} patched by the series, {len(overlay)} overlay files"
    )
    assert identical > 1000 and by_series == len(patched)


# What the install test imports, and what it asserts cannot load without a GPU.
IMPORT_CHECK = f"""
import importlib, importlib.metadata as md, json, torch
import vllm
from vllm.config.chunk_cache import ChunkCacheConfig
from {CONNECTOR} import ChunkCacheConnector
from vllm.config import VllmConfig
out = {{"vllm": md.version("vllm"), "vllm_file": vllm.__file__,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "connector": ChunkCacheConnector.__module__,
        "config_field": "chunk_cache_config" in VllmConfig.__dataclass_fields__,
        "flag": ChunkCacheConfig().enable_chunk_cache}}
# NOTE: vLLM's CUDA extension (_C_stable_libtorch: in both bases; 0.32 has no _C) links
# the NVIDIA driver's libcuda.so.1, which only a driver install provides (no pip package
# has it): on a machine without the driver it cannot load.
try:
    importlib.import_module("vllm._C_stable_libtorch")
    out["_C"] = "loaded"
except ImportError as e:
    out["_C"] = str(e)
print("RESULT " + json.dumps(out))
"""


def test_installs_with_pip_and_imports_without_a_gpu(built, tmp_path):
    paths, _, built_path = built
    torch_pin = paths.base.cuda.torch_pin
    torch_wheel = fetch.fetch(paths, [torch_pin])[torch_pin]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    try:
        _install_and_import(paths, built_path, torch_pin, torch_wheel, venv, tmp_path)
    finally:
        # NOTE: ~9 GB a base; pytest would keep it among its last three temporary
        # folders.
        shutil.rmtree(venv, ignore_errors=True)


def _install_and_import(paths, built_path, torch_pin, torch_wheel, venv, tmp_path):
    py = venv / "bin" / "python"
    t0 = time.monotonic()
    # NOTE: the wheel with its own requirements (pip resolves them: a METADATA rewrite
    # that broke resolution fails here), next to the torch it requires, nothing else.
    done = subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "--no-compile",
            "--progress-bar",
            "off",
            "--disable-pip-version-check",
            str(torch_wheel),
            str(built_path),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    installed = time.monotonic() - t0
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "FORK_"))}
    done = subprocess.run(
        [str(py), "-c", IMPORT_CHECK],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**env, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    version = load_pins(paths.pins_file)[paths.base.cuda.wheel_pin].version
    torch_version = load_pins(paths.pins_file)[torch_pin].version
    assert out["vllm"] == f"{version}+chunkcache.cu130"
    assert out["vllm_file"].startswith(str(venv))
    assert (out["torch"], out["torch_cuda"]) == (f"{torch_version}+cu130", "13.0")
    assert out["cuda_available"] is False
    assert (
        out["connector"] == CONNECTOR and out["config_field"] and out["flag"] is False
    )
    assert out["_C"] == "loaded" or "libcuda.so.1" in out["_C"], out["_C"]
    print(
        f"[cuda_wheel] {paths.base.name}: pip install {installed:.0f} s; extension: "
        f"{out['_C'][:120]}"
    )
