"""The patch-series tool on the real pinned bases: apply/export round trip and
`check`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from forktool import bases, check, tree
from forktool.git import git
from forktool.paths import Paths
from forktool.series import read_series

REAL = Paths.default()


@pytest.fixture
def fork_repo(tmp_path: Path) -> Paths:
    """A scratch copy of the repository's series and overlay, sharing the real
    downloads."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(REAL.pins_file, repo / "pins.toml")
    shutil.copytree(REAL.repo / "patches", repo / "patches")
    # `./fork check` also checks the reviewer's page against the series.
    (repo / "docs").mkdir()
    shutil.copy(REAL.repo / "docs" / "upstream.md", repo / "docs" / "upstream.md")
    (repo / "tests").symlink_to(REAL.repo / "tests")  # the tests the page names
    for name in ("vllm", "vllm-ascend"):
        if (REAL.repo / name).exists():
            shutil.copytree(
                REAL.repo / name,
                repo / name,
                ignore=shutil.ignore_patterns("__pycache__"),
            )
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "downloads").symlink_to(REAL.downloads)
    return Paths(repo=repo, cache=cache)


def run_check(paths: Paths, tree_name: str = "vllm") -> check.CheckReport:
    report = check.CheckReport()
    found = [
        bases.base_for(paths, tree_name, kind) for kind in bases.TREE_BASES[tree_name]
    ]
    check.check_tree(paths, tree_name, found, report)
    return report


def snapshot(paths: Paths) -> dict[str, bytes]:
    files = {}
    for root in ("patches", "vllm", "vllm-ascend"):
        for f in (
            sorted((paths.repo / root).rglob("*"))
            if (paths.repo / root).exists()
            else []
        ):
            if f.is_file() and "__pycache__" not in f.parts:
                files[f.relative_to(paths.repo).as_posix()] = f.read_bytes()
    return files


def test_repository_series_checks_clean_on_every_base():
    report = check.CheckReport()
    for tree_name, kinds in bases.TREE_BASES.items():
        check.check_tree(
            REAL, tree_name, [bases.base_for(REAL, tree_name, k) for k in kinds], report
        )
    assert report.ok, report.problems
    # vllm: sdist tree and wheel tree; vllm-ascend: its sdist.
    assert len(report.checked) == 3


@pytest.mark.parametrize("kind", ["sdist", "wheel"])
def test_apply_then_export_is_byte_identical(fork_repo: Paths, kind: str):
    before = snapshot(fork_repo)
    src = tree.apply(fork_repo, bases.base_for(fork_repo, "vllm", kind), force=False)
    n_patches = len(read_series(fork_repo.patches_dir("vllm")))
    # upstream + one commit per patch + the overlay commit
    log = git(src, "rev-list", "HEAD").split()
    assert len(log) == 1 + n_patches + 1
    assert tree.export(fork_repo, "vllm", src) == []
    assert snapshot(fork_repo) == before


def test_export_writes_a_new_commit_as_a_new_patch(fork_repo: Paths):
    src = tree.apply(fork_repo, bases.base_for(fork_repo, "vllm", "wheel"), force=False)
    target = src / "vllm" / "envs.py"
    target.write_text(target.read_text() + "\n# chunk-cache test edit\n")
    new_module = src / "vllm" / "v1" / "core" / "chunk_test_only.py"
    new_module.write_text("X = 1\n")
    git(src, "add", "-A")
    git(
        src,
        "commit",
        "-q",
        "-m",
        "envs: test edit\n\nWhat: a test edit.\nWhy: testing.\nDrop-when: at once.",
    )
    changed = tree.export(fork_repo, "vllm", src)
    names = read_series(fork_repo.patches_dir("vllm"))
    assert names[-1].endswith("-envs-test-edit.patch")
    assert (
        fork_repo.repo / "vllm" / "v1" / "core" / "chunk_test_only.py"
    ).read_text() == "X = 1\n"
    assert any("envs-test-edit" in c for c in changed)
    # The patch touches only the upstream file; the new module went to the overlay.
    text = (fork_repo.patches_dir("vllm") / names[-1]).read_text()
    assert "vllm/envs.py" in text and "chunk_test_only" not in text
    assert run_check(fork_repo).ok
    # Exporting again changes nothing.
    assert tree.export(fork_repo, "vllm", src) == []


OVERLAY_FILE = "vllm/v1/core/chunk_structures.py"


def test_export_keeps_an_overlay_file_edited_in_the_repository(fork_repo: Paths):
    """Issue 7, finding 9: before, export copied the tree's stale copy over it."""
    src = tree.apply(fork_repo, bases.base_for(fork_repo, "vllm", "wheel"), force=False)
    repo_file = fork_repo.repo / OVERLAY_FILE
    edited = repo_file.read_text() + "\n# edited in the repository after apply\n"
    repo_file.write_text(edited)
    new_file = fork_repo.repo / "vllm" / "v1" / "core" / "chunk_new_in_repo.py"
    new_file.write_text("Y = 2\n")
    tree.export(fork_repo, "vllm", src)
    assert repo_file.read_text() == edited
    assert new_file.read_text() == "Y = 2\n"


def test_export_refuses_when_repository_and_tree_both_edited_an_overlay_file(
    fork_repo: Paths,
):
    src = tree.apply(fork_repo, bases.base_for(fork_repo, "vllm", "wheel"), force=False)
    (fork_repo.repo / OVERLAY_FILE).write_text("# repository version\n")
    (src / OVERLAY_FILE).write_text("# tree version\n")
    git(src, "commit", "-qam", "overlay edit in the tree")
    before = snapshot(fork_repo)
    with pytest.raises(Exception, match="edited in the repository since"):
        tree.export(fork_repo, "vllm", src)
    assert snapshot(fork_repo) == before  # nothing written


def test_export_refuses_uncommitted_edits(fork_repo: Paths):
    src = tree.apply(fork_repo, bases.base_for(fork_repo, "vllm", "wheel"), force=False)
    (src / "vllm" / "envs.py").write_text("broken\n")
    with pytest.raises(Exception, match="uncommitted changes"):
        tree.export(fork_repo, "vllm", src)


def test_apply_refuses_to_overwrite_a_tree(fork_repo: Paths):
    base = bases.base_for(fork_repo, "vllm", "wheel")
    tree.apply(fork_repo, base, force=False)
    with pytest.raises(Exception, match="already exists"):
        tree.apply(fork_repo, base, force=False)


def _first_patch(paths: Paths) -> Path:
    return paths.patches_dir("vllm") / read_series(paths.patches_dir("vllm"))[0]


def test_check_fails_on_a_broken_patch(fork_repo: Paths):
    p = _first_patch(fork_repo)
    text = p.read_text()
    # Corrupt one context line of the first hunk: the patch no longer matches upstream.
    lines = text.splitlines(keepends=True)
    hunk = next(i for i, x in enumerate(lines) if x.startswith("@@"))
    i = next(
        i
        for i in range(hunk, len(lines))
        if lines[i].startswith(" ") and len(lines[i]) > 3
    )
    lines[i] = " THIS LINE IS NOT UPSTREAM\n"
    p.write_text("".join(lines))
    report = run_check(fork_repo)
    assert not report.ok
    assert any(
        p.name in msg and "does not apply cleanly" in msg for msg in report.problems
    )


def test_check_fails_on_a_patch_missing_from_series(fork_repo: Paths):
    extra = fork_repo.patches_dir("vllm") / "0099-orphan.patch"
    shutil.copy(_first_patch(fork_repo), extra)
    report = run_check(fork_repo)
    assert report.problems == [
        "vllm/0099-orphan.patch is not listed in series (unused patch)"
    ]


def test_check_fails_on_a_series_entry_without_file(fork_repo: Paths):
    series = fork_repo.patches_dir("vllm") / "series"
    series.write_text(series.read_text() + "0042-missing.patch\n")
    report = run_check(fork_repo)
    assert report.problems == ["vllm/series lists 0042-missing.patch, which is missing"]


def test_check_fails_on_a_duplicate_series_entry(fork_repo: Paths):
    series = fork_repo.patches_dir("vllm") / "series"
    first = read_series(fork_repo.patches_dir("vllm"))[0]
    series.write_text(series.read_text() + first + "\n")
    report = run_check(fork_repo)
    assert any("lists" in m and "2 times" in m for m in report.problems)


@pytest.mark.parametrize("field", ["What", "Why", "Drop-when"])
def test_check_fails_on_a_missing_header_field(fork_repo: Paths, field: str):
    p = _first_patch(fork_repo)
    head, sep, diff = p.read_text().partition("\n---\n")
    head = "\n".join(x for x in head.splitlines() if not x.startswith(f"{field}:"))
    p.write_text(head + sep + diff)
    report = run_check(fork_repo)
    assert any(f"missing '{field}:' line" in m and p.name in m for m in report.problems)


def test_check_fails_on_an_overlay_file_that_shadows_upstream(fork_repo: Paths):
    shadow = fork_repo.repo / "vllm" / "envs.py"
    shadow.write_text("# not allowed\n")
    report = run_check(fork_repo)
    assert any(
        "overlay file vllm/envs.py exists upstream" in m for m in report.problems
    )


# NOTE: ~40 s (an sdist apply and every overlay module imported) on the 2-core CI
# machine, where .ci/run runs `./fork check` for each base anyway (exit 0 there); the
# problems it reports are checked by run_check above, so the command's exit codes are in
# the slow tier.
@pytest.mark.slow
def test_check_command_exit_code(fork_repo: Paths, monkeypatch):
    from forktool import cli
    from forktool.releases import DEFAULT, RELEASES

    monkeypatch.setattr(
        cli.Paths, "default", classmethod(lambda cls, base=None: fork_repo)
    )
    # The default release only: the second base's downloads and venv are made by its own
    # tier, later in CI (tests/tools/test_releases.py covers check's per-release parts).
    monkeypatch.setattr(cli, "RELEASES", {DEFAULT: RELEASES[DEFAULT]})
    (fork_repo.cache / "venv").symlink_to(REAL.venv)  # overlay imports: the real venv
    assert cli.main(["check"]) == 0
    (fork_repo.patches_dir("vllm") / "0099-orphan.patch").write_text("x")
    assert cli.main(["check"]) == 1
