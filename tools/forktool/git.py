"""Thin git wrapper with a fixed identity and diff settings, so trees and exports are
deterministic whatever the user's git configuration says."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .progress import ToolError

_ENV = {
    "GIT_AUTHOR_NAME": "chunk-cache fork", "GIT_AUTHOR_EMAIL": "fork@localhost",
    "GIT_COMMITTER_NAME": "chunk-cache fork", "GIT_COMMITTER_EMAIL": "fork@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1",
}
_CONFIG = ["-c", "core.autocrlf=false", "-c", "core.quotePath=true", "-c", "diff.noprefix=false",
           "-c", "diff.mnemonicPrefix=false", "-c", "diff.relative=false",
           "-c", "commit.gpgSign=false", "-c", "init.defaultBranch=main",
           "-c", "core.hooksPath=/dev/null"]


def git(cwd: Path, *args: str, input: str | None = None, check: bool = True) -> str:
    env = dict(os.environ, **_ENV)
    proc = subprocess.run(["git", *_CONFIG, *args], cwd=cwd, env=env, input=input,
                          capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ToolError(f"git {' '.join(args[:3])} failed in {cwd}:\n{proc.stderr.strip()}")
    return proc.stdout


def apply_patch(cwd: Path, diff: str, *, index: bool) -> str | None:
    """Apply strictly (no fuzz). Returns None on success, git's complaint otherwise."""
    args = ["apply", "--whitespace=nowarn"] + (["--index"] if index else [])
    env = dict(os.environ, **_ENV)
    proc = subprocess.run(["git", *_CONFIG, *args, "-"], cwd=cwd, env=env, input=diff,
                          capture_output=True, text=True)
    return None if proc.returncode == 0 else proc.stderr.strip()
