"""The CPU wheel's one compiled member of ours: the one-pass K load (gather_rotate.c).

Compiled here, when the wheel is built, with the build machine's C compiler, and shipped in
the wheel next to gather_rotate.py: the serving machine needs no compiler and no writable
cache directory (docs/design/rotation-paths.md). The source holds one body per ISA of vLLM's
CPU build (AVX-512, AVX2 + FMA + F16C, baseline x86-64) behind `#pragma GCC target`, picked
at the first call by the CPU's features, so the flags never name the build machine's CPU
(no -march=native).

Two libraries:
- `_gather_rotate.so`: rows split over OpenMP threads. Compiled with -fopenmp but linked
  WITHOUT libgomp: its GOMP_* symbols stay undefined and resolve, at load, to the OpenMP
  runtime torch already holds (gather_rotate.py makes it global first), so the process keeps
  one runtime and one thread pool (PyPI's torch ships its own libgomp; a library linked to
  the system's would start a second one).
- `_gather_rotate_serial.so`: no OpenMP at all, for a process whose torch holds no libgomp.
- `_gather_rotate.sha256.json`: their sha256, which the loader checks before dlopen.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .paths import Paths
from .progress import ToolError

SOURCE = "v1/worker/gather_rotate.c"  # inside the overlay's vllm/
TARGET_DIR = "vllm/v1/worker"
# sha256 of each library, as gather_rotate.py checks them before loading one.
DIGESTS = "_gather_rotate.sha256.json"
# -ffp-contract=off: a product the source rounds on its own must stay rounded (the rounding
# is chosen per rotation). -fno-math-errno: fmaf may be an instruction. No -march/-mtune:
# the ISA bodies are chosen in the source (#pragma GCC target) and at run time.
# -ffile-prefix-map and no build id: the same source and compiler give the same bytes.
COMPILE = ("-std=gnu11", "-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-Wall",
           "-Wno-unknown-pragmas", "-Werror")
LINK = ("-shared", "-Wl,--build-id=none", "-Wl,-z,noexecstack")
LIBRARIES = {
    "_gather_rotate.so": ("-fopenmp",),
    "_gather_rotate_serial.so": (),
}


def compiler() -> str:
    return os.environ.get("CC") or "gcc"


def _compile(cc: str, source: Path, extra: tuple[str, ...], target: Path) -> None:
    # NOTE: -fopenmp at compile time only (the command has no separate link step, so the
    # driver would add -lgomp): compile to an object, then link it without -fopenmp.
    with tempfile.TemporaryDirectory() as tmp:
        obj = Path(tmp) / "gather_rotate.o"
        prefix = f"-ffile-prefix-map={source.parent}=."
        commands = [
            [cc, *COMPILE, *extra, prefix, "-c", "-o", str(obj), str(source)],
            [cc, *LINK, "-o", str(target), str(obj), "-lm"],
        ]
        for command in commands:
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise ToolError(f"building the CPU kernel: {' '.join(command)}: {e}") from None
            if done.returncode != 0:
                raise ToolError(f"building the CPU kernel failed: {' '.join(command)}\n"
                                f"{done.stderr.strip()[-2000:]}")


def members(paths: Paths) -> dict[str, bytes]:
    """Wheel member name -> bytes of each compiled library."""
    source = paths.overlay_dir("vllm") / SOURCE
    cc = compiler()
    if shutil.which(cc) is None:
        raise ToolError(f"building the CPU wheel needs a C compiler: {cc!r} not found "
                        "(install gcc, or set CC)")
    out: dict[str, bytes] = {}
    digests: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in LIBRARIES.items():
            target = Path(tmp) / name
            _compile(cc, source, extra, target)
            out[f"{TARGET_DIR}/{name}"] = data = target.read_bytes()
            digests[name] = hashlib.sha256(data).hexdigest()
    # NOTE: checked before dlopen (gather_rotate.py): the loader maps a truncated library's
    # segments past the end of its file, and touching them is a SIGBUS, not an error.
    out[f"{TARGET_DIR}/{DIGESTS}"] = (json.dumps(digests, indent=1, sort_keys=True)
                                      + "\n").encode()
    return out


def digest_inputs(paths: Paths) -> list[bytes]:
    """What the libraries depend on besides the overlay's source (hashed into the wheel's
    inputs digest): this file (the flags) and the compiler's version."""
    try:
        version = subprocess.run([compiler(), "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = "no compiler"
    return [Path(__file__).read_bytes(), version.encode()]
