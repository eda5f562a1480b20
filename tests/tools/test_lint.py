# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`./fork lint` on tiny synthetic sdists and configs: the hooks and pinned requirements
read from a config, the files each hook selects, the findings parsed from each tool's
output, the count against stock, the target files and the lint tree. No network, no
pinned tool: the hooks run here are small local scripts."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest
from forktool import lint
from forktool.lint import Finding, Target
from forktool.lint_hooks import HookConfig, load_yaml, parse_config, rev_version
from forktool.paths import Paths
from forktool.pins import sha256_of
from forktool.progress import ToolError
from forktool.releases import RELEASES

CONFIG = """
default_stages: [pre-commit, manual]
exclude: 'vllm/third_party/.*'
repos:
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: v0.14.0
  hooks:
  - id: ruff-check
    args: [--output-format, github, --fix]
  - id: ruff-format
- repo: https://github.com/crate-ci/typos
  rev: v1.43.5
  hooks:
  - id: typos
    args: [--force-exclude]
- repo: https://github.com/pre-commit/mirrors-clang-format
  rev: v21.1.2
  hooks:
  - id: clang-format
    types_or: [c++, cuda]
- repo: https://github.com/astral-sh/uv-pre-commit
  rev: 0.11.1
  hooks:
  - id: pip-compile
    files: ^requirements/cuda\\.txt$
  - id: pip-compile
    alias: pip-compile-cpu
    files: ^requirements/cpu\\.txt$
- repo: local
  hooks:
  - id: mypy
    entry: python tools/pre_commit/mypy.py "3.11"
    <<: &mypy_common
      language: python
      types_or: [python, pyi]
      additional_dependencies: ["mypy==1.20.2", regex, "pydantic==2.13.5"]
  - id: mypy-3.12
    entry: python tools/pre_commit/mypy.py "3.12"
    <<: *mypy_common
    stages: [manual]
  - id: check-bad
    entry: python tools/pre_commit/check_bad.py
    language: python
    types: [python]
    additional_dependencies: [regex]
  - id: signoff-commit
    entry: bash
    language: system
    stages: [commit-msg]
"""

# A local hook as vLLM writes them: `file:line: message` per finding, exit status 1.
CHECK_BAD = """import sys
rc = 0
for name in sys.argv[1:]:
    for n, line in enumerate(open(name), 1):
        if "BAD" in line:
            print(f"\\x1b[91m{name}:{n}: BAD found\\x1b[0m")
            rc = 1
sys.exit(rc)
"""


def config() -> HookConfig:
    return parse_config(load_yaml(CONFIG))


def hook(cfg: HookConfig, hook_id: str):
    return next(h for h in cfg.hooks if h.id == hook_id)


def test_the_pinned_tools_come_from_the_config():
    cfg = config()
    assert hook(cfg, "ruff-check").requirements == ("ruff==0.14.0",)
    assert hook(cfg, "ruff-format").kind == "ruff-format"
    assert hook(cfg, "typos").requirements == ("typos==1.43.5",)
    # The mypy hook's additional_dependencies verbatim, through the YAML merge key.
    assert hook(cfg, "mypy").requirements == (
        "mypy==1.20.2",
        "regex",
        "pydantic==2.13.5",
    )
    assert hook(cfg, "mypy").is_mypy
    assert hook(cfg, "mypy").argv == ("python", "tools/pre_commit/mypy.py", "3.11")
    assert cfg.requirements() == (
        "mypy==1.20.2",
        "pydantic==2.13.5",
        "regex",
        "ruff==0.14.0",
        "typos==1.43.5",
    )
    # No PyPI package runs clang-format or pip-compile here: nothing pinned for them.
    assert hook(cfg, "clang-format").kind == ""
    assert hook(cfg, "pip-compile-cpu").files == r"^requirements/cpu\.txt$"
    assert rev_version("v0.14.0") == "0.14.0"
    with pytest.raises(ToolError):
        rev_version("745eface02aef23e168a8afb6b5737818efbea95")


def test_stages_pick_the_hooks_pre_commit_runs():
    cfg = config()
    pre_commit = [h.id for h in cfg.in_stage("pre-commit")]
    assert "mypy" in pre_commit
    assert "mypy-3.12" not in pre_commit
    assert "signoff-commit" not in pre_commit
    assert "mypy-3.12" in [h.id for h in cfg.in_stage("manual")]


def test_each_hook_selects_its_files():
    cfg = config()
    py, c, md = "vllm/x.py", "vllm/v1/worker/kernel.c", "docs/x.md"
    assert hook(cfg, "ruff-check").selects(py)
    assert not hook(cfg, "ruff-check").selects(c)
    assert hook(cfg, "typos").selects(md)
    # clang-format takes c++ and cuda here: a C file is not one.
    assert not hook(cfg, "clang-format").selects(c)
    assert not hook(cfg, "pip-compile").selects(py)
    assert hook(cfg, "pip-compile").selects("requirements/cuda.txt")
    # The config's top-level exclude.
    assert not hook(cfg, "ruff-check").selects("vllm/third_party/y.py", cfg.exclude)


def test_only_what_stock_lacks_counts():
    def f(file: str, code: str, line: int) -> Finding:
        return Finding(file, "ruff-check", code, "Line too long", line)

    patched = [f("a.py", "E501", 3), f("a.py", "E501", 9), f("a.py", "I001", 1)]
    stock = [f("a.py", "E501", 7), f("b.py", "E501", 1)]
    # Line numbers move with the patch: one E501 of a.py is stock's own.
    assert [x.key for x in lint.new_findings(patched, stock)] == [
        ("a.py", "ruff-check", "E501", "Line too long"),
        ("a.py", "ruff-check", "I001", "Line too long"),
    ]
    assert lint.new_findings(patched, patched) == []


def test_each_tools_output_is_parsed(tmp_path: Path):
    cfg = config()
    ruff_json = json.dumps(
        [
            {
                "filename": str(tmp_path / "vllm/a.py"),
                "code": "E501",
                "message": "Line too long (90 > 88)",
                "location": {"row": 4, "column": 89},
            }
        ]
    )
    (got,) = lint.parse_output(hook(cfg, "ruff-check"), 1, ruff_json, [], tmp_path)
    assert (got.file, got.code, got.line) == ("vllm/a.py", "E501", 4)
    out = "Would reformat: vllm/a.py\n1 file would be reformatted\n"
    (got,) = lint.parse_output(
        hook(cfg, "ruff-format"), 1, out, ["vllm/a.py"], tmp_path
    )
    assert (got.file, got.code) == ("vllm/a.py", "reformat")
    out = (
        "$ mypy --python-version 3.11 \n"
        'vllm/a.py:12: error: Item "None" of "X | None" has no attribute "y"  '
        "[union-attr]\n"
        "vllm/a.py:13: note: See https://mypy.readthedocs.io\n"
        "Found 1 error in 1 file (checked 1 source file)\n"
    )
    (got,) = lint.parse_output(hook(cfg, "mypy"), 1, out, ["vllm/a.py"], tmp_path)
    assert (got.file, got.code, got.line) == ("vllm/a.py", "union-attr", 12)
    typo = {"type": "typo", "path": "vllm/a.py", "line_num": 2, "typo": "teh"}
    typo["corrections"] = ["the"]
    (got,) = lint.parse_output(hook(cfg, "typos"), 2, json.dumps(typo), [], tmp_path)
    assert (got.file, got.code, got.message) == ("vllm/a.py", "teh", "-> the")
    # A local hook: the line that names the file, colours and line number left out.
    out = "\x1b[91mvllm/a.py:20: error:\x1b[0m Found forbidden import: re.\n"
    (got,) = lint.parse_output(hook(cfg, "check-bad"), 1, out, ["vllm/a.py"], tmp_path)
    assert (got.file, got.line, got.message) == (
        "vllm/a.py",
        20,
        "error: Found forbidden import: re.",
    )
    # A failing hook that names no file still counts, once.
    (got,) = lint.parse_output(hook(cfg, "check-bad"), 3, "boom\n", ["x.py"], tmp_path)
    assert (got.file, got.code) == ("", "exit 3")
    assert (
        lint.parse_output(hook(cfg, "check-bad"), 0, "ok\n", ["x.py"], tmp_path) == []
    )


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _venv(tmp_path: Path) -> Path:
    """A stand-in lint venv: its python is this interpreter."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / "venv" / "bin" / "python")
    return tmp_path / "venv"


def test_a_series_target_counts_against_stock(tmp_path: Path):
    tools = {"tools/pre_commit/check_bad.py": CHECK_BAD}
    patched = _tree(
        tmp_path / "patched",
        {
            **tools,
            "vllm/a.py": "x = 1  # BAD\ny = 2  # BAD\n",
            "vllm/new.py": "z = 3  # BAD\n",
            "README.md": "BAD\n",
        },
    )
    stock = _tree(tmp_path / "stock", {**tools, "vllm/a.py": "x = 1  # BAD\n"})
    cfg = HookConfig(
        hooks=(hook(config(), "check-bad"), hook(config(), "clang-format"))
    )
    target = Target(
        "series vllm 0.23",
        RELEASES["0.23"],
        "vllm",
        ("README.md", "vllm/a.py", "vllm/new.py"),
        against_stock=True,
    )
    result = lint.lint_target(
        target, cfg, _venv(tmp_path), patched, "pre-commit", stock
    )
    (bad,) = result.results
    # a.py: one of its two findings is stock's own; new.py has no stock copy.
    assert sorted(f.file for f in bad.findings) == ["vllm/a.py", "vllm/new.py"]
    assert bad.on_stock == 1
    assert result.total == 2
    assert result.not_applicable == ["clang-format"]
    assert "check-bad" in lint.report([result])
    # The same files as a target without stock: every finding counts.
    alone = Target("overlay vllm (0.23)", RELEASES["0.23"], "vllm", target.files)
    assert lint.lint_target(alone, cfg, _venv(tmp_path / "o"), patched, "x").total == 0
    assert (
        lint.lint_target(alone, cfg, tmp_path / "venv", patched, "pre-commit").total
        == 3
    )


def _sdist(path: Path, top: str, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


PATCH = """Subject: change a.py, drop gone.py

What: x
Why: y
Drop-when: z
---
diff --git a/vllm/a.py b/vllm/a.py
--- a/vllm/a.py
+++ b/vllm/a.py
@@ -1 +1,2 @@
 x = 1
+y = 2
diff --git a/vllm/gone.py b/vllm/gone.py
deleted file mode 100644
--- a/vllm/gone.py
+++ /dev/null
@@ -1 +0,0 @@
-g = 1
"""


def test_the_lint_tree_is_the_sdist_with_its_series_and_the_overlay(tmp_path: Path):
    repo, cache = tmp_path / "repo", tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    sdist = cache / "downloads" / "vllm-0.23.0.tar.gz"
    files = {"vllm/a.py": "x = 1\n", "vllm/gone.py": "g = 1\n"}
    _sdist(sdist, "vllm-0.23.0", {**files, ".pre-commit-config.yaml": CONFIG})
    (repo / "patches" / "vllm").mkdir(parents=True)
    (repo / "patches" / "vllm" / "0001-a.patch").write_text(PATCH)
    (repo / "patches" / "vllm" / "series").write_text("0001-a.patch\n")
    (repo / "vllm" / "v1").mkdir(parents=True)
    (repo / "vllm" / "v1" / "mine.py").write_text("m = 1\n")
    (repo / "pins.toml").write_text(
        '[vllm]\npackage = "vllm"\nversion = "0.23.0"\nkind = "sdist"\n'
        f'file = "vllm-0.23.0.tar.gz"\nsha256 = "{sha256_of(sdist)}"\n'
    )
    paths = Paths(repo=repo, cache=cache, base=RELEASES["0.23"])
    rel = RELEASES["0.23"]
    tree = lint.ensure_tree(paths, rel, "vllm")
    assert tree == cache / "lint" / "trees" / "vllm-0.23"
    assert (tree / "vllm" / "a.py").read_text() == "x = 1\ny = 2\n"
    # The deleted file has nothing to check.
    assert lint.series_files(paths, rel, "vllm", tree) == ["vllm/a.py"]
    assert lint.lay_overlay(paths, tree, "vllm") == ["vllm/v1/mine.py"]
    stock = lint.ensure_stock(tree)
    assert (stock / "vllm" / "a.py").read_text() == "x = 1\n"
    assert not (stock / "vllm" / "v1" / "mine.py").exists()
    assert "ruff-check" in [h.id for h in lint.read_config(tree).hooks]
    # A second run reuses the tree, back to the series without the last overlay.
    (tree / "vllm" / "a.py").write_text("edited\n")
    assert lint.ensure_tree(paths, rel, "vllm") == tree
    assert (tree / "vllm" / "a.py").read_text() == "x = 1\ny = 2\n"
    assert not (tree / "vllm" / "v1" / "mine.py").exists()


def test_the_tests_are_laid_next_to_the_newest_config(tmp_path: Path):
    repo = _tree(tmp_path / "repo", {"tests/unit/test_x.py": "", "tests/data.json": ""})
    cfg_tree = _tree(tmp_path / "t", {"pyproject.toml": "[tool.ruff]\n"})
    paths = Paths(repo=repo, cache=tmp_path / "cache", base=RELEASES["0.23"])
    laid = lint.lay_tests(paths, cfg_tree, "tests-0.32")
    assert (laid / "pyproject.toml").read_text() == "[tool.ruff]\n"
    assert lint.test_files(laid) == ["tests/data.json", "tests/unit/test_x.py"]
    newest = max(RELEASES, key=lambda n: tuple(int(x) for x in n.split(".")))
    assert lint.newest_with("vllm").name == newest
    assert lint.newest_with("vllm-ascend").name == "0.23"
