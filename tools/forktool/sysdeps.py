"""sysdeps: the Debian libraries the chunk store's package (Mooncake) loads at import.

`mooncake-transfer-engine-non-cuda` (requirements/dev.txt) links libibverbs (the verbs
library, not RDMA hardware: the store runs over TCP here) and libnuma. Where `./fork` runs as
root with apt-get (CI's fresh clone), it installs them; elsewhere it says what to install and
goes on: everything but the chunk store works without them, and the store's tests fail with
the same instructions (tests/store_fleet.py).
"""

from __future__ import annotations

import ctypes.util
import os
import shutil

from .progress import run, say, step

# soname -> the Debian/Ubuntu package that ships it.
STORE_LIBRARIES = {"ibverbs": "libibverbs1", "numa": "libnuma1"}
INSTALL_HINT = ("apt-get install -y --no-install-recommends "
                + " ".join(STORE_LIBRARIES.values()))


def missing_store_libraries() -> list[str]:
    """The Debian packages whose library the dynamic loader cannot find."""
    return [pkg for lib, pkg in STORE_LIBRARIES.items() if ctypes.util.find_library(lib) is None]


def ensure_store_libraries() -> None:
    missing = missing_store_libraries()
    if not missing:
        return
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if os.geteuid() == 0 and shutil.which("apt-get"):
        with step(f"installing {' '.join(missing)} with apt-get (the chunk store's "
                  "Mooncake package loads them)"):
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            run(["apt-get", "update", "-q"], env=env, quiet=True)
            run(cmd, env=env, quiet=True)
        return
    say(f"the chunk store (--chunk-store, Mooncake) needs {' '.join(missing)}, which this "
        f"user cannot install; everything else works without it. Install with: "
        f"sudo {' '.join(cmd)}")
