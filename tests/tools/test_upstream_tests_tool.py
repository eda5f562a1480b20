"""`./fork upstream-tests` reads a pytest run right (tools/forktool/upstream_tests.py):
each test's outcome by id, a collection error charged to its file with the exception it
raised, and a regression is exactly a test that passed on stock and not on the patched
side. The runs are real pytest processes over a small folder of tests written here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tools.forktool.paths import Paths
from tools.forktool.releases import RELEASES
from tools.forktool.upstream_tests import (
    LISTS,
    FileReport,
    FileRun,
    Side,
    listed_files,
    run_files,
    version,
)

FILES = {
    "tests/test_a.py": (
        "import pytest\n"
        "def test_passes(): assert True\n"
        "def test_fails(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped(): pass\n"
        "class TestGroup:\n"
        "    def test_in_class(self): pass\n"
    ),
    "tests/test_broken.py": "import no_such_module_here\n",
}


def test_a_run_is_read_per_test_and_per_file(tmp_path: Path):
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    paths = Paths(repo=Paths.default().repo, cache=tmp_path)
    runs = run_files(
        paths, Path(sys.executable), sorted(FILES), Side("x", tmp_path, ())
    )

    assert runs["tests/test_a.py"].outcomes == {
        "tests/test_a.py::test_passes": "passed",
        "tests/test_a.py::test_fails": "failed",
        "tests/test_a.py::test_skipped": "skipped",
        "tests/test_a.py::TestGroup::test_in_class": "passed",
    }
    assert "one is not two" in runs["tests/test_a.py"].reason
    broken = runs["tests/test_broken.py"]
    assert list(broken.outcomes.values()) == ["error"]
    assert "No module named 'no_such_module_here'" in broken.reason


def test_a_regression_is_a_stock_pass_that_is_not_a_patched_pass():
    stock = FileRun(
        {"f::a": "passed", "f::b": "passed", "f::c": "failed", "f::d": "passed"}
    )
    patched = FileRun({"f::a": "passed", "f::b": "error", "f::c": "passed"})
    report = FileReport("f", stock, patched)
    # b errs, d is no longer collected; c failing on stock is listed, not counted.
    assert report.regressions == ["f::b", "f::d"]
    assert not report.cannot_run
    assert FileReport("g", FileRun({"g::x": "failed"}), FileRun({})).cannot_run


@pytest.mark.parametrize("base", sorted(RELEASES))
def test_every_listed_file_has_kept_results_on_both_sides(base):
    """CI's upstream stage runs only the patched side and reads stock from
    stock-<version>.json; a listed file missing there makes CI unpack and run stock in
    its own time, and one missing from patched-<version>.json leaves docs/upstream.md's
    counts behind, which `./fork check` then fails on."""
    paths = Paths.default(base)
    ver = version(paths)
    stock = json.loads((LISTS / f"stock-{ver}.json").read_text())
    patched = json.loads((LISTS / f"patched-{ver}.json").read_text())
    files = listed_files(paths, "full")
    assert [f for f in files if f not in stock] == []
    assert [f for f in files if f not in patched] == []
