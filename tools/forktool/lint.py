"""lint: vLLM's own pre-commit hooks on the fork, each base's from its own sdist.

Three kinds of target:
  - each release's series, per tree: the files the series changes, as patched, with that
    base's hooks; only findings stock's copy of the same file does not already have count
    (a multiset of (file, hook, code, message), line numbers left out);
  - the overlay of each tree, laid into the newest release's patched tree of that tree
    (as tree.py lays it out), with that release's hooks;
  - the repository's tests/ with the newest release's ruff-check and ruff-format, laid out as
    tests/ next to that release's pyproject.toml.
The trees live in .cache/lint/trees (an extracted sdist, the series applied with git, the
overlay copied in: mypy follows imports through the whole tree); the pinned tools in a venv
of their own under .cache/lint, keyed by the pinned set.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from . import fetch, tree
from .bases import Base
from .git import apply_patch, git
from .lint_hooks import Hook, HookConfig, load_yaml, parse_config
from .paths import Paths
from .pins import load_pins
from .progress import ToolError, run, say, step
from .releases import RELEASES, Release
from .series import load_patches

# The tests target runs only these (mypy and the local hooks are vLLM's checks of vLLM's
# own tree; the fork's tests are checked for style).
TESTS_HOOKS = ("ruff-check", "ruff-format")


@dataclass(frozen=True)
class Finding:
    file: str
    hook: str
    code: str
    message: str
    # Where (for the report); not part of the comparison with stock.
    line: int = 0

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.file, self.hook, self.code, self.message)

    def render(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else (self.file or "-")
        return f"{where}: {self.hook} {self.code} {self.message}".rstrip()


@dataclass(frozen=True)
class Target:
    # e.g. "series vllm 0.32", "overlay vllm-ascend (0.23)", "tests (0.32)".
    name: str
    release: Release
    # The tree the target's files are in ("tests": the laid-out tests/).
    tree: str
    # Tree-relative files.
    files: tuple[str, ...]
    # Compare with stock's copy of the files (the series targets).
    against_stock: bool = False
    # Only these hooks (None: every hook of the base).
    only_hooks: tuple[str, ...] | None = None


@dataclass
class HookResult:
    hook: str
    # Counted findings (new against stock where the target compares with stock).
    findings: list[Finding] = field(default_factory=list)
    # Findings stock's copy has too (not counted).
    on_stock: int = 0


@dataclass
class TargetResult:
    target: Target
    results: list[HookResult] = field(default_factory=list)
    not_applicable: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(len(r.findings) for r in self.results)


def lint_root(paths: Paths) -> Path:
    return paths.cache / "lint"


# -- findings ------------------------------------------------------------------------------

def new_findings(patched: list[Finding], stock: list[Finding]) -> list[Finding]:
    """The findings of `patched` that `stock` does not have, compared as a multiset of
    (file, hook, code, message): a message stock has twice and the patched file three times
    counts once."""
    left = Counter(f.key for f in stock)
    out = []
    for f in patched:
        if left[f.key] > 0:
            left[f.key] -= 1
        else:
            out.append(f)
    return out


_MYPY_LINE = re.compile(r"^(?P<file>[^:\s]+):(?P<line>\d+)(?::\d+)?: error: (?P<msg>.*?)"
                        r"(?:  \[(?P<code>[a-z0-9-]+)\])?$")
_CODESPELL_LINE = re.compile(r"^(?P<file>[^:\s]+):(?P<line>\d+): (?P<msg>.+)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PY_PATH = re.compile(r"[\w./-]+\.pyi?\b")


def parse_output(hook: Hook, rc: int, out: str, files: list[str], cwd: Path) -> list[Finding]:
    """A hook's findings from its exit code and output."""
    if hook.kind == "ruff-check" and out.lstrip().startswith("["):
        return [Finding(_rel(d["filename"], cwd), hook.id, d.get("code") or "syntax",
                        d["message"], d["location"]["row"]) for d in json.loads(out or "[]")]
    if hook.kind == "ruff-format":
        found = [Finding(_rel(line.split(":", 1)[1].strip(), cwd), hook.id, "reformat",
                         "would reformat") for line in out.splitlines()
                 if line.startswith("Would reformat:")]
        return found or _generic(hook, rc, out, files)
    if hook.kind == "typos":
        found = []
        for line in out.splitlines():
            if line.startswith("{"):
                d = json.loads(line)
                if d.get("type") == "typo":
                    found.append(Finding(_rel(d["path"], cwd), hook.id, d["typo"],
                                         "-> " + ", ".join(d.get("corrections") or []),
                                         d.get("line_num", 0)))
        return found or _generic(hook, rc, out, files)
    if hook.kind == "codespell":
        found = [Finding(m["file"], hook.id, "spelling", m["msg"], int(m["line"]))
                 for m in map(_CODESPELL_LINE.match, out.splitlines()) if m]
        return found or _generic(hook, rc, out, files)
    if hook.is_mypy:
        found = [Finding(m["file"], hook.id, m["code"] or "error", m["msg"], int(m["line"]))
                 for m in map(_MYPY_LINE.match, out.splitlines()) if m]
        return found or _generic(hook, rc, out, files)
    return _generic(hook, rc, out, files)


def _generic(hook: Hook, rc: int, out: str, files: list[str]) -> list[Finding]:
    """A local hook's findings: a failing hook's output lines that name a file (one of
    `files`, else, for a hook that checks the whole tree, any .py path), one finding for
    the whole run when none does; a passing hook has none."""
    if rc == 0:
        return []
    found = []
    for raw in _ANSI.sub("", out).splitlines():
        line = raw.strip()
        named = [f for f in files if f in line]
        if not named and not hook.pass_filenames:
            named = _PY_PATH.findall(line)
        if named:
            m = re.search(rf"{re.escape(named[0])}(?::(\d+))?(?::\d+)?:?", line)
            assert m is not None
            message = (line[:m.start()] + line[m.end():]).strip(" :")
            found.append(Finding(named[0], hook.id, "", message, int(m[1] or 0)))
    if found:
        return found
    lines = [x.strip() for x in _ANSI.sub("", out).splitlines() if x.strip()]
    return [Finding("", hook.id, f"exit {rc}", lines[-1] if lines else "(no output)")]


def _rel(path: str, cwd: Path) -> str:
    p = Path(path)
    return p.relative_to(cwd).as_posix() if p.is_absolute() and p.is_relative_to(cwd) else path


# -- the lint venv -------------------------------------------------------------------------

def ensure_venv(paths: Paths, requirements: tuple[str, ...]) -> Path:
    """A venv with exactly the pinned requirements, shared by every config that pins them."""
    key = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:12]
    venv = lint_root(paths) / f"venv-{key}"
    done = venv / ".done"
    if done.exists() and done.read_text() == "\n".join(requirements):
        return venv
    if venv.exists():
        shutil.rmtree(venv)
    with step(f"lint venv {venv.name}: {' '.join(requirements)}"):
        run([sys.executable, "-m", "venv", str(venv)], quiet=True)
        run([venv / "bin" / "python", "-m", "pip", "install", "-q",
             "--disable-pip-version-check", *requirements], quiet=True)
    done.write_text("\n".join(requirements))
    return venv


# -- trees ---------------------------------------------------------------------------------

def _fetch_python(paths: Paths) -> Path | None:
    """A Python that can download an sdist (pip runs its setup.py): a fork venv's."""
    for rel in RELEASES.values():
        py = paths.for_base(rel).venv_python()
        if py.exists():
            return py
    return None


def base_of(paths: Paths, rel: Release, tree_name: str) -> Base:
    rel_paths = paths.for_base(rel)
    pin = load_pins(paths.pins_file)[rel.trees[tree_name]["sdist"]]
    path = fetch.fetch(rel_paths, [pin.name], python=_fetch_python(paths))[pin.name]
    return Base(tree=tree_name, release=rel.name, kind="sdist", path=path)


def ensure_tree(paths: Paths, rel: Release, tree_name: str) -> Path:
    """The release's sdist with its series applied (tag `series`; stock is tag `upstream`),
    extracted once per (sdist, series) and reset to that on every later run."""
    base = base_of(paths, rel, tree_name)
    patches = load_patches(paths.for_base(rel).patches_dir(tree_name))
    h = hashlib.sha256(base.path.name.encode())
    for p in patches:
        h.update(p.render().encode())
    key = h.hexdigest()
    dest = lint_root(paths) / "trees" / f"{tree_name}-{rel.name}"
    stamp = dest / ".git" / "fork-lint-key"
    if stamp.exists() and stamp.read_text() == key:
        git(dest, "reset", "-q", "--hard", "series")
        git(dest, "clean", "-fdxq", "-e", ".mypy_cache", "-e", ".ruff_cache")
        return dest
    for d in (dest, stock_dir(dest)):
        if d.exists():
            shutil.rmtree(d)
    with step(f"lint tree {dest.name}: {base.path.name} + {len(patches)} patches"):
        tree.init_upstream(dest, base)
        for patch in patches:
            problem = apply_patch(dest, patch.diff, index=True)
            if problem:
                raise ToolError(f"{patch.name} does not apply to {base.label()}:\n{problem}")
        git(dest, "commit", "-q", "--allow-empty", "-m", "the series")
        git(dest, "tag", "series")
    stamp.write_text(key)
    return dest


def stock_dir(tree_dir: Path) -> Path:
    return tree_dir.with_name(tree_dir.name + "-stock")


def ensure_stock(tree_dir: Path) -> Path:
    """Stock's tree (tag `upstream`) as a worktree next to the patched one."""
    dest = stock_dir(tree_dir)
    if not dest.exists():
        git(tree_dir, "worktree", "prune")
        git(tree_dir, "worktree", "add", "-q", "--detach", str(dest), "upstream")
    return dest


def lay_overlay(paths: Paths, tree_dir: Path, tree_name: str) -> list[str]:
    """Copy the repository's overlay of `tree_name` into the tree; its tree paths."""
    overlay = tree.overlay_files(paths, tree_name)
    upstream = set(git(tree_dir, "ls-tree", "-r", "--name-only", "upstream").splitlines())
    clash = sorted(set(overlay) & upstream)
    if clash:
        raise ToolError(f"overlay files replace upstream files (make them patches): {clash}")
    for rel, src in overlay.items():
        (tree_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, tree_dir / rel)
    return sorted(overlay)


def series_files(paths: Paths, rel: Release, tree_name: str, tree_dir: Path) -> list[str]:
    """The files the release's series changes that exist after it (a deleted file has
    nothing to check)."""
    touched = {p for patch in load_patches(paths.for_base(rel).patches_dir(tree_name))
               for p in patch.touched_paths()}
    return sorted(p for p in touched if (tree_dir / p).is_file())


def lay_tests(paths: Paths, config_tree: Path, name: str) -> Path:
    """The repository's tests/ next to `config_tree`'s pyproject.toml."""
    dest = lint_root(paths) / "trees" / name
    if dest.exists():
        shutil.rmtree(dest / "tests", ignore_errors=True)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config_tree / "pyproject.toml", dest / "pyproject.toml")
    shutil.copytree(paths.repo / "tests", dest / "tests",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def test_files(tests_dir: Path) -> list[str]:
    return sorted(p.relative_to(tests_dir).as_posix() for p in (tests_dir / "tests").rglob("*")
                  if p.is_file())


# -- running hooks -------------------------------------------------------------------------

def hook_argv(hook: Hook, venv: Path) -> list[str]:
    """The command pre-commit would run, minus what would write to the files: ruff check
    without --fix and with JSON output, ruff format with --check, typos with JSON output."""
    argv = list(hook.argv)
    if hook.kind == "ruff-check":
        out, skip = [], False
        for a in argv:
            if skip:
                skip = False
                continue
            if a == "--output-format":
                skip = True
                continue
            if a in ("--fix", "--unsafe-fixes") or a.startswith("--output-format="):
                continue
            out.append(a)
        argv = out + ["--no-fix", "--output-format", "json"]
    elif hook.kind == "ruff-format":
        argv = [a for a in argv if a != "--diff"] + ["--check"]
    elif hook.kind == "typos":
        argv = [a for a in argv if a not in ("--write-changes", "-w")] + ["--format", "json"]
    elif hook.kind == "codespell":
        argv = [a for a in argv if a not in ("--write-changes", "-w")]
    if argv and argv[0] in ("python", "python3"):
        argv[0] = str(venv / "bin" / "python")
    elif argv and hook.language == "script" and argv[0].endswith(".sh"):
        argv = ["bash", *argv]
    return argv


def run_hook(hook: Hook, venv: Path, cwd: Path, files: list[str]) -> list[Finding]:
    argv = hook_argv(hook, venv) + (files if hook.pass_filenames else [])
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    environ.update(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                   VIRTUAL_ENV=str(venv), NO_COLOR="1")
    proc = subprocess.run(argv, cwd=cwd, env=environ, capture_output=True, text=True)
    out = (proc.stdout + proc.stderr).replace(f"{cwd}/", "")
    return parse_output(hook, proc.returncode, out, files, cwd)


def of_target(found: list[Finding], files: list[str]) -> list[Finding]:
    """The findings in the target's files (a hook that checks the whole tree also reports
    files of other targets) and those that name no file."""
    wanted = set(files)
    return [f for f in found if not f.file or f.file in wanted]


def selected(hook: Hook, config: HookConfig, files: list[str]) -> list[str]:
    return [f for f in files if hook.selects(f, config.exclude)]


def lint_target(target: Target, config: HookConfig, venv: Path, cwd: Path, stage: str,
                stock: Path | None = None) -> TargetResult:
    """Run every hook of the stage that selects any of the target's files."""
    t0 = time.monotonic()
    result = TargetResult(target=target)
    for hook in config.in_stage(stage):
        if target.only_hooks is not None and hook.kind not in target.only_hooks:
            continue
        files = selected(hook, config, list(target.files))
        if not files and not hook.always_run:
            result.not_applicable.append(hook.id)
            continue
        if not hook.kind:
            result.results.append(HookResult(hook.id, [Finding(
                files[0] if files else "", hook.id, "not run",
                f"{hook.repo} hook: no known way to run it without pre-commit")]))
            continue
        found = of_target(run_hook(hook, venv, cwd, files), files)
        hr = HookResult(hook.id, found)
        if found and target.against_stock and stock is not None:
            # Stock's copies of the files (a file the series adds has none).
            on_stock = [f for f in files if (stock / f).is_file()]
            stock_found = (run_hook(hook, venv, stock, on_stock)
                           if on_stock or not hook.pass_filenames else [])
            new = new_findings(found, stock_found)
            hr = HookResult(hook.id, new, on_stock=len(found) - len(new))
        result.results.append(hr)
    result.seconds = time.monotonic() - t0
    return result


# -- the command ---------------------------------------------------------------------------

def _version_key(rel: Release) -> tuple[int, ...]:
    return tuple(int(x) for x in rel.name.split("."))


def newest_with(tree_name: str) -> Release:
    """The newest release that has `tree_name`."""
    return max((r for r in RELEASES.values() if tree_name in r.trees), key=_version_key)


def read_config(tree_dir: Path, venv_hint: Path | None = None) -> HookConfig:
    text = (tree_dir / ".pre-commit-config.yaml").read_text()
    return parse_config(load_yaml(text, venv_hint))


def _yaml_python(paths: Paths) -> Path | None:
    """A Python with PyYAML where this one has none (pre-commit reads its config with it):
    a lint venv of PyYAML alone."""
    try:
        import yaml  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return ensure_venv(paths, ("PyYAML",)) / "bin" / "python"
    return None


def main(paths: Paths, stage: str = "pre-commit", only: list[str] | None = None) -> int:
    newest = max(RELEASES.values(), key=_version_key)
    results: list[TargetResult] = []
    wanted = set(only or ("series", "overlay", "tests"))
    for rel in sorted(RELEASES.values(), key=_version_key):
        for tree_name in rel.trees:
            if "sdist" not in rel.trees[tree_name]:
                continue
            overlay_here = "overlay" in wanted and newest_with(tree_name) == rel
            tests_here = "tests" in wanted and tree_name == "vllm" and rel == newest
            if "series" not in wanted and not overlay_here and not tests_here:
                continue
            tree_dir = ensure_tree(paths, rel, tree_name)
            config = read_config(tree_dir, _yaml_python(paths))
            venv = ensure_venv(paths, config.requirements())
            overlay = lay_overlay(paths, tree_dir, tree_name)
            if "series" in wanted:
                target = Target(f"series {tree_name} {rel.name}", rel, tree_name,
                                tuple(series_files(paths, rel, tree_name, tree_dir)),
                                against_stock=True)
                results.append(_run(target, config, venv, tree_dir, stage,
                                    ensure_stock(tree_dir)))
            if overlay_here:
                target = Target(f"overlay {tree_name} ({rel.name})", rel, tree_name,
                                tuple(overlay))
                results.append(_run(target, config, venv, tree_dir, stage))
            if tests_here:
                tests_dir = lay_tests(paths, tree_dir, f"tests-{rel.name}")
                target = Target(f"tests ({rel.name})", rel, "tests",
                                tuple(test_files(tests_dir)), only_hooks=TESTS_HOOKS)
                results.append(_run(target, config, venv, tests_dir, stage))
    print(report(results))
    return 0 if all(r.total == 0 for r in results) else 1


def _run(target: Target, config: HookConfig, venv: Path, cwd: Path, stage: str,
         stock: Path | None = None) -> TargetResult:
    with step(f"lint {target.name}: {len(target.files)} files"):
        return lint_target(target, config, venv, cwd, stage, stock)


def report(results: list[TargetResult]) -> str:
    lines = []
    for r in results:
        lines.append(f"== {r.target.name}: {len(r.target.files)} files, {r.seconds:.0f} s")
        for f in (f for hr in r.results for f in hr.findings):
            lines.append(f"  {f.render()}")
        for hr in r.results:
            extra = f" (stock's copy has {hr.on_stock} more, not counted)" if hr.on_stock else ""
            lines.append(f"  {hr.hook:<32} {len(hr.findings):>5}{extra}")
        if r.not_applicable:
            lines.append("  not applicable (no file of theirs): "
                         + ", ".join(dict.fromkeys(r.not_applicable)))
        lines.append(f"  {'total':<32} {r.total:>5}")
    grand = sum(r.total for r in results)
    lines.append(f"== lint: {grand} finding(s) in {len(results)} target(s)")
    return "\n".join(lines)
