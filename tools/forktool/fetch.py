"""fetch: download the pinned artifacts through pip from PyPI and verify their sha256."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from .paths import Paths
from .pins import Pin, load_pins, sha256_of
from .progress import ToolError, run, say, step

# NOTE: pip runs an sdist's metadata step even for `pip download`. vLLM's setup.py imports
# torch, setuptools_scm and setuptools_rust and appends a local version (+empty/+cpu) that pip
# then rejects; VLLM_TARGET_DEVICE=empty + VLLM_VERSION_OVERRIDE keep the version as pinned.
# vllm-ascend's setup.py wants SOC_VERSION and setuptools_scm. So sdists are downloaded with a
# Python that has those (the fork's venv), wheels with any pip.
SDIST_ENV = {
    "vllm": {"VLLM_TARGET_DEVICE": "empty"},
    "vllm-ascend": {"SOC_VERSION": "ascend910b1"},
}


def artifact_path(paths: Paths, pin: Pin) -> Path:
    return paths.downloads / pin.file


def verified(paths: Paths, pin: Pin) -> bool:
    path = artifact_path(paths, pin)
    return path.exists() and sha256_of(path) == pin.sha256


def fetch(paths: Paths, names: list[str], python: Path | None = None) -> dict[str, Path]:
    """Download each named pin unless a verified copy is already cached."""
    pins = load_pins(paths.pins_file)
    out: dict[str, Path] = {}
    for name in names:
        if name not in pins:
            raise ToolError(f"unknown pin {name!r}; pins.toml has {sorted(pins)}")
        pin = pins[name]
        out[name] = _fetch_one(paths, pin, python)
    return out


def _fetch_one(paths: Paths, pin: Pin, python: Path | None) -> Path:
    dest = artifact_path(paths, pin)
    if verified(paths, pin):
        return dest
    if pin.kind == "sdist" and python is None:
        # NOTE: pip's metadata step would run the sdist's setup.py under whatever Python
        # runs this tool (torch, setuptools-rust, setuptools >= 77 for vLLM's): on a fresh
        # machine that fails deep inside pip (tools/gpu/pack.sh, 2026-11-26). Say so first.
        raise ToolError(f"downloading the sdist {pin.file} runs its setup.py through pip, "
                        "which needs the fork's venv (torch, setuptools-rust): run "
                        f"`./fork setup --base {paths.base.name}` first")
    paths.downloads.mkdir(parents=True, exist_ok=True)
    with step(f"downloading {pin.file}"), tempfile.TemporaryDirectory(dir=paths.cache) as tmp:
        cmd = [str(python or sys.executable), "-m", "pip", "download", "--no-deps",
               "--disable-pip-version-check", "-d", tmp]
        env = dict(os.environ)
        if pin.kind == "sdist":
            cmd += ["--no-binary", ":all:", "--no-build-isolation"]
            env.update(SDIST_ENV.get(pin.package, {}))
            if pin.package == "vllm":
                env["VLLM_VERSION_OVERRIDE"] = pin.version
        else:
            cmd += ["--only-binary", ":all:"]
        run(cmd + [pin.requirement], env=env, quiet=True)
        got = Path(tmp) / pin.file
        if not got.exists():
            raise ToolError(f"pip did not produce {pin.file} (got {os.listdir(tmp)})")
        digest = sha256_of(got)
        if digest != pin.sha256:
            raise ToolError(f"sha256 mismatch for {pin.file}: pinned {pin.sha256}, got {digest}")
        os.replace(got, dest)
    say(f"verified {pin.file} sha256={pin.sha256[:12]}...")
    return dest
