"""docs/upstream.md against the series (issue 41): the line counts are the patch files'
own (git's count is the oracle), the repository's page passes, and a page with a patch
left out, a count changed or an entry missing fails with a message naming the patch."""

from __future__ import annotations

import re
import subprocess

import pytest
from forktool import upstream_page
from forktool.check import CheckReport
from forktool.paths import Paths
from forktool.releases import RELEASES
from forktool.series import load_patches

REAL = Paths.default()
PAGE = (REAL.repo / upstream_page.PAGE).read_text()


def numstat(patch_file, tmp_path) -> dict[str, upstream_page.Lines]:
    """Git's own count of a patch file's added and removed lines, per file."""
    # NOTE: outside any work tree: inside one, git apply skips the paths that are not
    # under the current directory, and reports nothing for them.
    out = subprocess.run(
        ["git", "apply", "--numstat", "-"],
        input=patch_file.read_text(),
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    counts = {}
    for line in out.splitlines():
        added, removed, path = line.split("\t")
        counts[path] = upstream_page.Lines(int(added), int(removed))
    return counts


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_line_counts_equal_gits_count_of_every_patch_file(release, tmp_path):
    patch_dir = REAL.for_base(RELEASES[release]).patches_dir("vllm")
    patches = load_patches(patch_dir)
    assert patches
    for patch in patches:
        assert upstream_page.diff_lines(patch.diff) == numstat(
            patch_dir / patch.name, tmp_path
        ), patch.name


def test_lines_that_look_like_headers_inside_a_hunk_are_counted():
    diff = (
        "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,3 @@\n"
        " keep\n--- removed, starts like a header\n+++ added, starts like a header\n"
        " keep\n\\ No newline at end of file\n"
    )
    assert upstream_page.diff_lines(diff) == {"x.py": upstream_page.Lines(1, 1)}


def test_the_repositorys_page_matches_the_series():
    report = CheckReport()
    upstream_page.check_page(REAL, report)
    assert report.ok, report.problems


def problems(text: str) -> list[str]:
    return upstream_page.page_problems(REAL, text)


def test_a_patch_left_out_of_the_table_fails_naming_it():
    row = next(ln for ln in PAGE.splitlines() if ln.startswith("| 0017 |"))
    found = problems(PAGE.replace(row + "\n", ""))
    assert any(
        "patch 0017" in p and "missing from the patch table" in p for p in found
    ), found
    assert any("generated patch tables differ" in p for p in found), found


def test_a_changed_line_count_fails_with_both_numbers():
    row = next(ln for ln in PAGE.splitlines() if ln.startswith("| 0006 |"))
    cells = row.split(" | ")
    # The 0.32.0 column, before 0.33.0's: the patch adds 48 lines there.
    assert cells[-2] == "+48 / -0"
    changed = " | ".join(cells[:-2] + ["+24 / -0", cells[-1]])
    found = problems(PAGE.replace(row, changed))
    assert (
        "docs/upstream.md: patch 0006 on vLLM 0.32.0: the page says '+24 / -0', the "
        "patch file has '+48 / -0'"
    ) in found, found


def test_a_page_without_the_generated_block_or_a_review_entry_fails():
    start = PAGE.index(upstream_page.BEGIN)
    end = PAGE.index(upstream_page.END) + len(upstream_page.END)
    found = problems(PAGE[:start] + PAGE[end:])
    assert any("no patch table" in p for p in found), found
    assert any("no generated patch tables" in p for p in found), found
    entry = re.search(r"^### 0012\b.*$", PAGE, flags=re.M).group(0)
    found = problems(PAGE.replace(entry, "### (entry removed)"))
    assert any("patch 0012" in p and "`### 0012` entry" in p for p in found), found


def test_a_named_test_that_does_not_exist_fails():
    found = problems(PAGE + "\nBacked by tests/e2e/test_no_such_module.py.\n")
    assert found == [
        "docs/upstream.md names tests/e2e/test_no_such_module.py, which does not exist"
    ]


def test_the_page_before_issue_41_fails():
    """The shape of the page at 10399cf: one count column under a heading naming 0.32.0,
    no row for 0017, 0006's count short by 13, no generated block, no review entries."""
    rows = [
        f"| {n} | subject | `file.py` | +1 / -0 |"
        for n in (f"{i:04d}" for i in range(1, 17))
    ]
    old = (
        "## The patches (0.32.0 series, in order)\n\n"
        "| # | subject | files it touches | lines (+/-) |\n|---|---|---|---|\n"
        + "\n".join(rows).replace(
            "| 0006 | subject | `file.py` | +1 / -0 |",
            "| 0006 | subject | `file.py` | +24 / -0 |",
        )
        + "\n"
    )
    found = problems(old)
    assert any("no line-count column for vLLM 0.23.0" in p for p in found), found
    assert any("patch 0017" in p and "missing" in p for p in found), found
    assert (
        "docs/upstream.md: patch 0006 on vLLM 0.32.0: the page says '+24 / -0', the "
        "patch file has '+48 / -0'"
    ) in found
    assert any("no generated patch tables" in p for p in found), found


def test_write_page_replaces_only_the_generated_block(tmp_path):
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    import shutil

    shutil.copytree(REAL.repo / "patches", repo / "patches")
    stale = PAGE.replace("+48 / -0", "+1 / -0")
    (repo / upstream_page.PAGE).write_text(stale)
    paths = Paths(repo=repo, cache=tmp_path / "cache")
    upstream_page.write_page(paths)
    assert (repo / upstream_page.PAGE).read_text() == PAGE
