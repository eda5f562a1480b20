"""`./fork env` installs what changed, once (pip is replaced by a recorder: no
downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
from forktool import env
from forktool.paths import Paths
from forktool.wheel import BuiltWheel


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch) -> tuple[Paths, list[list[str]]]:
    repo = tmp_path / "repo"
    (repo / "requirements").mkdir(parents=True)
    for name in ("constraints.txt", "dev.txt"):
        (repo / "requirements" / name).write_text("")
    paths = Paths(repo=repo, cache=tmp_path / "cache")
    calls: list[list[str]] = []

    def fake_run(cmd, **kwargs):
        cmd = [str(c) for c in cmd]
        calls.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            python = Path(cmd[3]) / "bin" / "python"
            python.parent.mkdir(parents=True)
            python.write_text("")
        elif "install" in cmd and any(c.endswith(".whl") and "vllm" in c for c in cmd):
            site = paths.venv / "lib" / "python3.11" / "site-packages"
            (site / "vllm-0.23.0.dist-info").mkdir(parents=True, exist_ok=True)
        return ""

    monkeypatch.setattr(env, "run", fake_run)
    return paths, calls


def wheel_installs(calls):
    return [c for c in calls if any(a.endswith(".whl") and "vllm" in a for a in c)]


def test_a_new_venv_installs_the_wheel_once(scratch, tmp_path):
    paths, calls = scratch
    torch_wheel = tmp_path / "torch-2.11.0-cp311-none-any.whl"
    built = BuiltWheel(
        path=tmp_path / "vllm-0.23.0+chunkcache.cpu.whl", inputs_digest="d1"
    )
    env.ensure_env(paths, torch_wheel, built)
    assert len(wheel_installs(calls)) == 1
    # Nothing changed: nothing installed.
    calls.clear()
    env.ensure_env(paths, torch_wheel, built)
    assert calls == []
    # A rebuilt wheel is swapped in alone.
    env.ensure_env(paths, torch_wheel, BuiltWheel(path=built.path, inputs_digest="d2"))
    assert len(wheel_installs(calls)) == 1 and "--force-reinstall" in calls[0]


def test_a_base_reinstall_over_an_old_build_still_swaps_the_wheel_in(scratch, tmp_path):
    paths, calls = scratch
    torch_wheel = tmp_path / "torch-2.11.0-cp311-none-any.whl"
    built = BuiltWheel(
        path=tmp_path / "vllm-0.23.0+chunkcache.cpu.whl", inputs_digest="d1"
    )
    env.ensure_env(paths, torch_wheel, built)
    (paths.repo / "requirements" / "dev.txt").write_text("pytest\n")  # the base changed
    calls.clear()
    env.ensure_env(paths, torch_wheel, built)
    # pip may keep the older build of the same version: the swap must run too.
    assert (
        len(wheel_installs(calls)) == 2
        and "--force-reinstall" in wheel_installs(calls)[1]
    )
