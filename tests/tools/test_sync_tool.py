"""`./fork sync --device`: the overlay is copied into the venv of the device asked for
(.cache/venv on cpu, .cache/venv-cuda on cuda), and only there."""

from __future__ import annotations

from pathlib import Path

import pytest
from forktool import cli

ROOT = Path(__file__).resolve().parents[2]
# Any overlay module: the copy must be the repository's bytes.
OVERLAY_FILE = "vllm/v1/core/chunk_hash_index.py"


def _venv(cache: Path, name: str) -> Path:
    """A venv's `python` that answers sync's question (where is vllm?) with a folder of
    its own; returns that folder's parent, where the overlay lands."""
    site = cache / name / "site"
    (site / "vllm").mkdir(parents=True)
    python = cache / name / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho {site / 'vllm'}\n")
    python.chmod(0o755)
    return site


@pytest.mark.parametrize("dev, venv", [("cpu", "venv"), ("cuda", "venv-cuda")])
def test_sync_copies_the_overlay_into_the_devices_venv_only(
    tmp_path, monkeypatch, dev, venv
):
    cache = tmp_path / "cache"
    monkeypatch.setenv("FORK_CACHE", str(cache))
    monkeypatch.delenv("FORK_BASE", raising=False)
    sites = {name: _venv(cache, name) for name in ("venv", "venv-cuda")}
    assert cli.main(["sync", "--device", dev]) == 0
    copied = sites[venv] / OVERLAY_FILE
    assert copied.read_bytes() == (ROOT / OVERLAY_FILE).read_bytes()
    other = next(site for name, site in sites.items() if name != venv)
    assert not (other / OVERLAY_FILE).exists()


def test_sync_names_the_command_that_makes_a_missing_venv(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("FORK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FORK_BASE", raising=False)
    assert cli.main(["sync", "--device", "cuda"]) == 1
    assert "run `./fork env --device cuda` first" in capsys.readouterr().err
