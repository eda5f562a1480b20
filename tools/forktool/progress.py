"""Visible progress for long steps: one line when a step starts, one when it ends."""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Sequence


def say(msg: str) -> None:
    print(f"[fork] {msg}", file=sys.stderr, flush=True)


@contextmanager
def step(title: str) -> Iterator[None]:
    t0 = time.monotonic()
    say(f"{title} ...")
    yield
    say(f"{title}: done in {time.monotonic() - t0:.0f} s")


class ToolError(RuntimeError):
    """A failure with a message meant for the user (printed without a traceback)."""


def run(cmd: Sequence[str], *, cwd=None, env=None, quiet: bool = False,
        input: str | None = None) -> str:
    """Run a command; on failure raise ToolError with its output so the user sees why."""
    proc = subprocess.run(list(map(str, cmd)), cwd=cwd, env=env, input=input,
                          capture_output=quiet, text=True)
    if proc.returncode != 0:
        detail = (proc.stdout or "") + (proc.stderr or "") if quiet else ""
        raise ToolError(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{detail}")
    return proc.stdout or ""
