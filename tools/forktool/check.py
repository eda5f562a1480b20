"""check: the series and its files agree, every patch has its header, and the series applies
cleanly (strictly, in order) to each base of its tree."""

from __future__ import annotations

import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .bases import Base
from .paths import Paths
from .series import Patch, apply_series, read_series
from .tree import overlay_files


@dataclass
class CheckReport:
    # One line per problem, each naming the patch or file it is about.
    problems: list[str] = field(default_factory=list)
    # What was checked, for the success message.
    checked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_series_files(patch_dir: Path, report: CheckReport) -> list[Patch]:
    """Series <-> files consistency and headers. Returns the parseable patches in order."""
    names = read_series(patch_dir)
    for name, n in Counter(names).items():
        if n > 1:
            report.problems.append(f"{patch_dir.name}/series lists {name} {n} times")
    on_disk = {p.name for p in patch_dir.glob("*.patch")}
    for name in sorted(on_disk - set(names)):
        report.problems.append(f"{patch_dir.name}/{name} is not listed in series (unused patch)")
    patches = []
    for name in dict.fromkeys(names):
        path = patch_dir / name
        if not path.exists():
            report.problems.append(f"{patch_dir.name}/series lists {name}, which is missing")
            continue
        try:
            patch = Patch.parse(name, path.read_text())
        except Exception as e:  # ToolError with the reason
            report.problems.append(str(e))
            continue
        for problem in patch.header_problems():
            report.problems.append(f"{patch_dir.name}/{name}: header: {problem} "
                                   "(a header needs What:, Why:, Drop-when:)")
        patches.append(patch)
    return patches


def check_applies(base: Base, patches: list[Patch], overlay: set[str],
                  report: CheckReport) -> None:
    """Apply the series in order to the files it touches, taken from the base."""
    touched = {p for patch in patches for p in patch.touched_paths()}
    files = base.read_files(touched | overlay)
    clash = sorted(overlay & set(files))
    for rel in clash:
        report.problems.append(f"overlay file {rel} exists upstream in {base.label()}: "
                               "edit it through a patch instead")
    result = apply_series(files, patches)
    if result.failed is not None:
        report.problems.append(f"{result.failed.name} does not apply cleanly to "
                               f"{base.label()}: {result.problem}")
        return
    report.checked.append(f"{len(patches)} patches apply to {base.label()}")


def check_tree(paths: Paths, tree: str, bases: list[Base], report: CheckReport) -> None:
    before = len(report.problems)
    patches = check_series_files(paths.patches_dir(tree), report)
    if len(report.problems) > before:
        return
    overlay = set(overlay_files(paths, tree))
    for base in bases:
        check_applies(base, patches, overlay, report)


_FAILED = "overlay-import-failed: "


def overlay_modules(paths: Paths) -> dict[str, Path]:
    """Dotted name -> repository file of the vLLM tree's overlay modules (the fork's new
    Python modules), sorted by name."""
    out = {}
    for rel, path in overlay_files(paths, "vllm").items():
        if rel.endswith(".py"):
            out[rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")] = path
    return dict(sorted(out.items()))


def check_overlay_imports(paths: Paths, report: CheckReport) -> None:
    """Import every overlay module in the release's venv, against its installed, patched vLLM.

    NOTE: importing needs torch and the release's vLLM, so it runs in that release's venv
    (`./fork env --base X` makes it); a missing venv is a failure, never a skip. vllm-ascend's
    overlay needs torch_npu and is covered by tests/unit/ascend instead.
    """
    py = paths.venv_python()
    label = f"vllm {paths.base.name}"
    if not py.exists():
        report.problems.append(f"overlay imports against {label}: no venv at {paths.venv} "
                               f"(run `./fork env --base {paths.base.name}`)")
        return
    mods = overlay_modules(paths)
    code = ("import importlib, sys\n"
            "bad = []\n"
            "for m in sys.argv[1:]:\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except Exception as e:\n"
            "        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
            f"print(''.join('{_FAILED}' + b + chr(10) for b in bad))\n")
    proc = subprocess.run([str(py), "-c", code, *mods], capture_output=True, text=True,
                          cwd=paths.cache)
    if proc.returncode != 0:
        report.problems.append(f"overlay imports against {label} crashed:\n{proc.stderr[-2000:]}")
        return
    # NOTE: vLLM logs to stdout while it imports; only marked lines are failures.
    failed = [line[len(_FAILED):] for line in proc.stdout.splitlines()
              if line.startswith(_FAILED)]
    for line in failed:
        report.problems.append(f"overlay module does not import against {label}: {line}")
    if not failed:
        report.checked.append(f"{len(mods)} overlay modules import against {label} "
                              f"({paths.venv.name})")
