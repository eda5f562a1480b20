"""A tree's patch series: the `series` file, patch files, and their headers."""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .git import apply_patch
from .progress import ToolError

# Every patch header must answer these, each on a line of its own ("Field: text").
HEADER_FIELDS = ("What", "Why", "Drop-when")
# Between the header (the commit message) and the diff.
DIFF_MARKER = "\n---\n"


@dataclass(frozen=True)
class Patch:
    # File name inside patches/<tree>/, e.g. "0001-config-add-chunk-cache-config.patch".
    name: str
    # The header: subject line, blank line, fields. Becomes the commit message in a tree.
    message: str
    # `git diff` output of the change (paths a/... b/...).
    diff: str

    @property
    def subject(self) -> str:
        return self.message.split("\n", 1)[0]

    def touched_paths(self) -> list[str]:
        return re.findall(r"^diff --git a/(\S+) b/", self.diff, flags=re.M)

    def render(self) -> str:
        return self.message + DIFF_MARKER + self.diff

    @classmethod
    def parse(cls, name: str, text: str) -> "Patch":
        head, sep, diff = text.partition(DIFF_MARKER)
        if not sep or not diff.startswith("diff --git "):
            raise ToolError(f"{name}: no header/diff split: expected the header, a line '---', "
                            "then a diff starting with 'diff --git'")
        return cls(name=name, message=head, diff=diff)

    def header_problems(self) -> list[str]:
        problems = []
        if not self.subject.strip():
            problems.append("empty subject line")
        for field in HEADER_FIELDS:
            m = re.search(rf"^{field}:[ \t]*(\S.*)?$", self.message, flags=re.M)
            if m is None:
                problems.append(f"missing '{field}:' line")
            elif not (m.group(1) or "").strip():
                problems.append(f"'{field}:' is empty")
        return problems


def read_series(patch_dir: Path) -> list[str]:
    """Patch names in order; `#` starts a comment; blank lines are ignored."""
    path = patch_dir / "series"
    if not path.exists():
        return []
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def load_patches(patch_dir: Path) -> list[Patch]:
    patches = []
    for name in read_series(patch_dir):
        file = patch_dir / name
        if not file.exists():
            raise ToolError(f"{patch_dir}/series lists {name}, which does not exist")
        patches.append(Patch.parse(name, file.read_text()))
    return patches


def slug(subject: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "-", subject).strip("-").lower()
    return s[:60].rstrip("-") or "patch"


SERIES_HEADER = "# Applied in this order by `./fork apply`; written by `./fork export`.\n"


def render_series(names: list[str]) -> str:
    return SERIES_HEADER + "".join(f"{n}\n" for n in names)


@dataclass(frozen=True)
class SeriesResult:
    # Path -> content after the series, for every path a patch touches (None: deleted).
    files: dict[str, bytes | None]
    # The first patch that did not apply, and git's complaint; None when all applied.
    failed: Patch | None = None
    problem: str = ""


def apply_series(upstream: dict[str, bytes], patches: list[Patch]) -> SeriesResult:
    """Apply `patches` strictly, in order, to the upstream files they touch."""
    touched = {p for patch in patches for p in patch.touched_paths()}
    # NOTE: a temporary directory outside any git work tree, so `git apply` acts as a plain
    # strict patch tool on these files (inside a repository it would resolve paths against
    # that repository's root).
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rel in touched & set(upstream):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(upstream[rel])
        for patch in patches:
            problem = apply_patch(root, patch.diff, index=False)
            if problem:
                return SeriesResult(files={}, failed=patch, problem=problem)
        return SeriesResult(files={rel: (root / rel).read_bytes() if (root / rel).exists()
                                   else None for rel in touched})
