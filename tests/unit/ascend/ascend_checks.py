"""Runs the Ascend check scripts with the stub `torch_npu` and the patched vllm-ascend
tree on PYTHONPATH, vLLM on its CPU platform: one check in a process of its own, or a
batch of checks, each in a child forked after the imports (check_batch.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.unit.ascend.check_batch import ARGS, BEGIN, END

HERE = Path(__file__).resolve().parent


def _env(ascend_tree: Path, first: Path | None) -> dict[str, str]:
    path = [str(HERE / "stubs"), str(ascend_tree)]
    if first is not None:
        path.insert(0, str(first))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "VLLM_LOGGING_LEVEL": "WARNING",
        # vLLM stays on its CPU platform (the tree's metadata would activate
        # vllm-ascend's NPU platform, which needs a real torch_npu device).
        "VLLM_PLUGINS": "none",
    }
    return env


def run_check(
    script: str,
    check: str,
    ascend_tree: Path,
    *args: str,
    first: Path | None = None,
    timeout: int = 600,
) -> str:
    """Run `check` of `script` (a file next to this one); returns its stdout."""
    proc = subprocess.run(
        [sys.executable, str(HERE / script), check, *args],
        env=_env(ascend_tree, first),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and f"OK {check}" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-5000:]
    )
    return proc.stdout


@dataclass(frozen=True)
class CheckOutcome:
    exit_code: int
    output: str

    def assert_ok(self, check: str) -> None:
        assert self.exit_code == 0 and f"OK {check}" in self.output, self.output[-5000:]


def run_checks(
    script: str,
    checks: list[str],
    ascend_tree: Path,
    args: dict[str, list[str]] | None = None,
    timeout: int = 1200,
) -> dict[str, CheckOutcome]:
    """Run `checks` of `script` as one batch (`args`: a check's arguments, by name);
    each check's outcome by name. A check that is missing from the output (the batch
    died before it) has exit code -1."""
    tokens = [ARGS.join([c, *(args or {}).get(c, [])]) for c in checks]
    proc = subprocess.run(
        [sys.executable, str(HERE / script), "--batch", *tokens],
        env=_env(ascend_tree, None),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    outcomes: dict[str, CheckOutcome] = {}
    name, lines = None, []
    for line in proc.stdout.splitlines():
        if line.startswith(BEGIN):
            name, lines = line[len(BEGIN) :], []
        elif line.startswith(END) and name is not None:
            outcomes[name] = CheckOutcome(int(line.rsplit(" ", 1)[1]), "\n".join(lines))
            name = None
        elif name is not None:
            lines.append(line)
    tail = proc.stdout[-2000:] + proc.stderr[-5000:]
    for check in checks:
        outcomes.setdefault(
            check, CheckOutcome(-1, f"not run (batch exit {proc.returncode}):\n{tail}")
        )
    return outcomes
