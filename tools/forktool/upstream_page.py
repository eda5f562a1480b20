"""docs/upstream.md, the page that presents the vLLM series to a vLLM reviewer: its patch
tables are generated from the patch files of every release, and `./fork check` fails when
the page and the series disagree.

What is generated (between the BEGIN/END markers, rewritten by `./fork upstream-page
--write`): one row per patch (subject, upstream files, lines added/removed on each release)
and one row per upstream file. What is checked, with a message naming the patch:
  * every patch of every release's vLLM series has a row in the page's patch table, whose
    line counts equal the patch file's, and no row names a patch the series lacks;
  * the generated block is the one the series gives today (subjects, files, totals);
  * every patch has its own review entry (a `### NNNN` heading);
  * every `tests/...py` file the page names exists (the page's claims about what runs with
    the chunk cache off must name the test that backs them).
Line counts are the '+' and '-' lines of each hunk, read by the hunk header's line
counts, so a removed line that starts with "--" or an added one that starts with "++" is
counted as git counts it (`git apply --numstat` is the test's oracle).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from .paths import Paths
from .releases import RELEASES, Release
from .series import Patch, load_patches

PAGE = Path("docs") / "upstream.md"
TREE = "vllm"
BEGIN = ("<!-- BEGIN generated patch tables: `./fork upstream-page --write` writes them from "
         "patches/; `./fork check` fails when they differ -->")
END = "<!-- END generated patch tables -->"
# The heading of the section that holds one `### NNNN ...` entry per patch.
REVIEW_HEADING = "## Each patch, as a reviewer reads it"

# How the series would go upstream: one PR per line, in merge order. Every patch is in
# exactly one; `./fork check` fails otherwise (a new patch must be placed here).
PR_SPLIT: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("1. KV connector: hooks for a connector that keeps its own KV (no chunk-cache code)",
     ("0004", "0006", "0007", "0013", "0019")),
    ("2. scheduler and V1 runner: a connector loads stretches in the middle of a prompt",
     ("0012", "0017")),
    ("3. the chunk cache: config, request layout, engine budget, connector",
     ("0001", "0002", "0005", "0008", "0010", "0011")),
    ("4. front end: prompts given as segments, chat documents, opt-out",
     ("0003", "0009", "0014", "0015", "0016", "0018")),
)

_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_COUNT = re.compile(r"^\+(\d+) / -(\d+)$")
_RELEASE_IN_TEXT = re.compile(r"\b0\.(\d+)(?:\.\d+)?\b")


@dataclass(frozen=True)
class Lines:
    added: int = 0
    removed: int = 0

    def __add__(self, other: "Lines") -> "Lines":
        return Lines(self.added + other.added, self.removed + other.removed)

    def cell(self) -> str:
        return f"+{self.added} / -{self.removed}"


def diff_lines(diff: str) -> dict[str, Lines]:
    """Upstream path -> lines added and removed by a `git diff` text."""
    out: dict[str, Lines] = {}
    path = None
    old_left = new_left = 0
    for line in diff.split("\n"):
        if old_left or new_left:
            # Inside a hunk: its header said how many old and new lines follow.
            tag = line[:1]
            if tag == "+":
                out[path] += Lines(1, 0)
                new_left -= 1
            elif tag == "-":
                out[path] += Lines(0, 1)
                old_left -= 1
            elif tag == "\\":  # "\ No newline at end of file"
                pass
            else:  # context (" ", or an empty line where an editor stripped the space)
                old_left -= 1
                new_left -= 1
            continue
        m = re.match(r"^diff --git a/(\S+) b/", line)
        if m:
            path = m.group(1)
            out.setdefault(path, Lines())
            continue
        m = _HUNK.match(line)
        if m:
            old_left = int(m.group(1) if m.group(1) is not None else 1)
            new_left = int(m.group(2) if m.group(2) is not None else 1)
    return out


@dataclass(frozen=True)
class PatchStats:
    # The patch's row in the page: the number of the patch with the same subject in the
    # first release whose series has it (a series that drops a patch renumbers the rest).
    number: str
    subject: str
    files: dict[str, Lines]
    # Its number in its own series (the file name's); the row's number unless renumbered.
    file_number: str = ""

    @property
    def lines(self) -> Lines:
        return sum(self.files.values(), Lines())

    @classmethod
    def of(cls, patch: Patch) -> "PatchStats":
        return cls(patch.name[:4], patch.subject, diff_lines(patch.diff), patch.name[:4])


def release_label(release: Release) -> str:
    return f"{release.name}.0"


def series_stats(paths: Paths) -> dict[str, list[PatchStats]]:
    """Release name -> its vLLM series, counted, in order."""
    out: dict[str, list[PatchStats]] = {}
    # NOTE: patches are matched by subject, not number: a series that drops a patch (0.33
    # has no twin of 0.32's 0013) numbers the ones after it one lower.
    row_of: dict[str, str] = {}
    for name, release in RELEASES.items():
        rel_paths = paths.for_base(release)
        series = []
        for p in load_patches(rel_paths.patches_dir(TREE)):
            stats = PatchStats.of(p)
            row = row_of.setdefault(stats.subject, stats.number)
            series.append(replace(stats, number=row))
        out[name] = series
    return out


def renumbered(stats: dict[str, list[PatchStats]]) -> list[str]:
    """One line per release whose files are numbered otherwise than the page's rows."""
    out = []
    for name, series in stats.items():
        moved = [s for s in series if s.file_number != s.number]
        if moved:
            out.append(f"On vLLM {release_label(RELEASES[name])} the files are numbered "
                       "in its own series: " + ", ".join(
                           f"row {s.number} is its {s.file_number}" for s in moved) + ".")
    return out


def _short(path: str) -> str:
    return f"`{path.removeprefix('vllm/')}`"


def _files_cell(per_release: dict[str, PatchStats | None]) -> str:
    """The patch's files on the newest release that has it; where an older one differs,
    its own."""
    names = [name for name, stats in per_release.items() if stats is not None]
    newest = per_release[names[-1]]
    assert newest is not None
    shown = sorted(newest.files)
    cell = ", ".join(_short(p) for p in shown)
    for name in names[:-1]:
        stats = per_release[name]
        if stats is not None and sorted(stats.files) != shown:
            cell += f"; on {name}.0: " + ", ".join(_short(p) for p in sorted(stats.files))
    return cell


def generate(paths: Paths) -> str:
    """The generated block of docs/upstream.md, markers included."""
    stats = series_stats(paths)
    releases = list(stats)
    labels = [release_label(RELEASES[r]) for r in releases]
    numbers = sorted({s.number for series in stats.values() for s in series})
    by = {r: {s.number: s for s in series} for r, series in stats.items()}
    out = [BEGIN, "",
           "| # | patch (its header's subject line) | upstream files (`vllm/...`) | "
           + " | ".join(f"vLLM {label} (+/-)" for label in labels) + " |",
           "|---|---|---|" + "---|" * len(releases)]
    for n in numbers:
        row = {r: by[r].get(n) for r in releases}
        subject = next(s.subject for s in row.values() if s is not None)
        cells = [s.lines.cell() if s else "(not in this series)" for s in row.values()]
        out.append(f"| {n} | {subject} | {_files_cell(row)} | " + " | ".join(cells) + " |")
    files = {r: {} for r in releases}
    for r, series in stats.items():
        for s in series:
            for path, lines in s.files.items():
                files[r][path] = files[r].get(path, Lines()) + lines
    totals = [sum((s.lines for s in stats[r]), Lines()) for r in releases]
    out.append("| all | " + f"{len(numbers)} patches | "
               + ", ".join(f"{len(files[r])} files on {label}"
                           for r, label in zip(releases, labels)) + " | "
               + " | ".join(t.cell() for t in totals) + " |")
    moved = renumbered(stats)
    if moved:
        out += ["", *moved]
    out += ["", "Where the lines land, per upstream file (all patches together):", "",
            "| upstream file | patches | "
            + " | ".join(f"vLLM {label} (+/-)" for label in labels) + " |",
            "|---|---|" + "---|" * len(releases)]
    for path in sorted(set().union(*(f.keys() for f in files.values()))):
        touching = sorted({s.number for series in stats.values() for s in series
                           if path in s.files})
        cells = [files[r][path].cell() if path in files[r] else "-" for r in releases]
        out.append(f"| {_short(path)} | {', '.join(touching)} | " + " | ".join(cells) + " |")
    out += ["", "The proposed PRs (docs/upstream.md, \"The PRs\"), lines in upstream files only "
            "(new modules not counted):", "",
            "| PR | patches | " + " | ".join(f"vLLM {label} (+/-)" for label in labels) + " |",
            "|---|---|" + "---|" * len(releases)]
    for title, members in PR_SPLIT:
        cells = [sum((by[r][n].lines for n in members if n in by[r]), Lines()).cell()
                 for r in releases]
        out.append(f"| {title} | {', '.join(members)} | " + " | ".join(cells) + " |")
    out += ["", END]
    return "\n".join(out)


def write_page(paths: Paths) -> Path:
    """Replace the page's generated block with a fresh one."""
    page = paths.repo / PAGE
    text = page.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{PAGE} has no generated block: put the two marker lines\n"
                         f"{BEGIN}\n{END}\nwhere the patch tables go")
    page.write_text(text[:start] + generate(paths) + text[end + len(END):])
    return page


# ----------------------------------------------------------------------------- checks


@dataclass
class _Table:
    # Release name -> column index of its line counts.
    columns: dict[str, int] = field(default_factory=dict)
    # Patch number -> its cells.
    rows: dict[str, list[str]] = field(default_factory=dict)
    header: str = ""


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _patch_table(text: str) -> _Table | None:
    """The page's first table whose rows start with a patch number, read as cells. A count
    column is the release its header names, else the release the table's heading names."""
    heading = ""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("#"):
            heading = line
        if not (line.startswith("|") and i + 2 < len(lines)
                and re.match(r"^\|\s*\d{4}\s*\|", lines[i + 2])):
            continue
        table = _Table(header=line)
        for col, cell in enumerate(_cells(line)):
            m = _RELEASE_IN_TEXT.search(cell)
            in_heading = _RELEASE_IN_TEXT.search(heading)
            if m:
                table.columns.setdefault(f"0.{m.group(1)}", col)
            elif re.search(r"\blines\b", cell) and in_heading:
                table.columns.setdefault(f"0.{in_heading.group(1)}", col)
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            cells = _cells(row)
            if re.fullmatch(r"\d{4}", cells[0]):
                table.rows[cells[0]] = cells
        return table
    return None


def page_problems(paths: Paths, text: str) -> list[str]:
    """What is wrong with `text` as docs/upstream.md for the series in `paths`."""
    problems = []
    stats = series_stats(paths)
    table = _patch_table(text)
    if table is None:
        problems.append(f"{PAGE} has no patch table (a table whose rows start with a "
                        "patch number)")
    else:
        for name in stats:
            if name not in table.columns:
                problems.append(f"{PAGE}: the patch table has no line-count column for "
                                f"vLLM {release_label(RELEASES[name])} (its header: "
                                f"{table.header.strip()})")
        numbers: set[str] = set()
        missing: set[str] = set()
        for name, series in stats.items():
            for s in series:
                numbers.add(s.number)
                row = table.rows.get(s.number)
                if row is None:
                    if s.number in missing:
                        continue
                    missing.add(s.number)
                    problems.append(f"{PAGE}: patch {s.number} ({s.subject}) is missing "
                                    f"from the patch table")
                    continue
                col = table.columns.get(name)
                if col is None:
                    continue
                said = row[col] if col < len(row) else ""
                m = _COUNT.match(said)
                if m is None or Lines(int(m.group(1)), int(m.group(2))) != s.lines:
                    problems.append(
                        f"{PAGE}: patch {s.number} on vLLM {release_label(RELEASES[name])}: "
                        f"the page says {said or '(nothing)'!r}, the patch file has "
                        f"{s.lines.cell()!r}")
        for n in sorted(set(table.rows) - numbers):
            problems.append(f"{PAGE}: the patch table has a row {n}, which no series has")
    placed = [n for _, members in PR_SPLIT for n in members]
    for n in sorted({s.number for series in stats.values() for s in series}):
        if placed.count(n) != 1:
            problems.append(f"patch {n} is in {placed.count(n)} of the proposed PRs "
                            "(upstream_page.PR_SPLIT), not in exactly one")
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        problems.append(f"{PAGE} has no generated patch tables (the {BEGIN!r} and "
                        f"{END!r} lines): run `./fork upstream-page --write`")
    elif text[start:end + len(END)] != generate(paths):
        problems.append(f"{PAGE}: the generated patch tables differ from the series "
                        "(a subject, a file or a count changed): run "
                        "`./fork upstream-page --write`")
    review = text.partition(REVIEW_HEADING)[2].split("\n## ", 1)[0] if REVIEW_HEADING in text else ""
    if not review:
        problems.append(f"{PAGE} has no section {REVIEW_HEADING!r} (one `### NNNN` "
                        "entry per patch)")
    else:
        have = set(re.findall(r"^### (\d{4})\b", review, flags=re.M))
        for s in next(iter(stats.values())):
            if s.number not in have:
                problems.append(f"{PAGE}: patch {s.number} ({s.subject}) has no "
                                f"`### {s.number}` entry under {REVIEW_HEADING!r}")
    for test in sorted(set(re.findall(r"\btests/[\w/]+\.py\b", text))):
        if not (paths.repo / test).exists():
            problems.append(f"{PAGE} names {test}, which does not exist")
    return problems


def check_page(paths: Paths, report) -> None:
    page = paths.repo / PAGE
    if not page.exists():
        report.problems.append(f"{PAGE} does not exist")
        return
    found = page_problems(paths, page.read_text())
    report.problems.extend(found)
    if not found:
        n = len(next(iter(series_stats(paths).values())))
        report.checked.append(f"{PAGE} lists the {n} patches of every release with their "
                              "line counts, and an entry per patch")
