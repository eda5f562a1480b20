"""`./fork serve --chunk-store local` (the hub left on for a model named by hub id) and
the set-up of the store's Debian libraries."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from forktool import cli, local_store, models, sysdeps
from forktool.paths import Paths


def test_local_is_replaced_by_the_spec_in_both_spellings():
    assert local_store.with_spec(["a", "--chunk-store", "local", "b"], "S") == [
        "a",
        "--chunk-store",
        "S",
        "b",
    ]
    assert local_store.with_spec(["--chunk-store=local", "b"], "S") == [
        "--chunk-store",
        "S",
        "b",
    ]
    assert not local_store.wants_local_store(["--chunk-store", "mooncake://h:1"])
    assert not local_store.wants_local_store(["--chunk-store"])


def test_serve_starts_the_store_passes_its_spec_and_stops_it(tmp_path, monkeypatch):
    """A real master and client; a stand-in for `vllm serve` reports what it got."""
    report = tmp_path / "report.json"
    probe = (
        "import json, socket, sys\n"
        "spec = sys.argv[sys.argv.index('--chunk-store') + 1]\n"
        "port = int(spec.split('://')[1].split('?')[0].split(':')[1])\n"
        "s = socket.create_connection(('127.0.0.1', port), timeout=5); s.close()\n"
        "import os\n"
        "seen = {'spec': spec, 'argv': sys.argv[1:],"
        " 'offline': os.environ.get('HF_HUB_OFFLINE')}\n"
        f"json.dump(seen, open({str(report)!r}, 'w'))\n"
    )
    paths = Paths(repo=Path(__file__).resolve().parents[2], cache=tmp_path / "cache")
    monkeypatch.setenv("FORK_STORE_SEGMENT_MB", "32")
    # A hub id's serve (cli.ServeCommand.offline False): the hub is left on.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    pids = []
    real_enter = local_store.MooncakeFleet.__enter__

    def enter(self):
        fleet = real_enter(self)
        pids.extend([fleet.master.pid, fleet.client.pid])
        return fleet

    monkeypatch.setattr(local_store.MooncakeFleet, "__enter__", enter)
    rc = local_store.serve_with_local_store(
        paths,
        sys.executable,
        [sys.executable, "-c", probe, "--x", "--chunk-store", "local", "--y"],
        offline=False,
    )
    assert rc == 0
    got = json.loads(report.read_text())
    assert (
        got["spec"].startswith("mooncake://127.0.0.1:") and "timeout=5" in got["spec"]
    )
    assert got["argv"] == ["--x", "--chunk-store", got["spec"], "--y"]
    assert got["offline"] is None
    assert len(pids) == 2
    for pid in pids:  # stopped (and reaped) by pid on exit
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert sorted(
        p.name for p in (tmp_path / "cache" / "store-local").glob("*.log")
    ) == ["01-master.log", "02-client.log"]


@pytest.mark.parametrize(
    "model_args, offline",
    [([], True), (["--model", "org/not-downloaded"], False)],
)
def test_serve_with_the_local_store_is_offline_only_for_the_set_up_model(
    monkeypatch, model_args, offline
):
    """`./fork serve --model HUB_ID --chunk-store local` may download its model."""
    seen = {}

    def serve(paths, python, argv, offline=True):
        seen.update(argv=argv, offline=offline)
        return 0

    set_up = cli.Setup(python="/v/bin/python", models={models.SMOLLM2: "/m/smol"})
    monkeypatch.setattr(cli, "setup", lambda paths, **kw: set_up)
    monkeypatch.setattr(local_store, "serve_with_local_store", serve)
    argv = ["serve", "--device", "cpu", *model_args, "--chunk-store", "local"]
    assert cli.main(argv) == 0
    assert seen["offline"] is offline
    assert seen["argv"][2] == ("/m/smol" if offline else "org/not-downloaded")


def test_missing_libraries_are_installed_as_root(monkeypatch):
    calls = []
    monkeypatch.setattr(sysdeps, "missing_store_libraries", lambda: ["libnuma1"])
    monkeypatch.setattr(sysdeps.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sysdeps.shutil, "which", lambda name: "/usr/bin/apt-get")
    monkeypatch.setattr(sysdeps, "run", lambda cmd, **kw: calls.append(cmd) or "")
    sysdeps.ensure_store_libraries()
    assert calls == [
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "--no-install-recommends", "libnuma1"],
    ]


def test_missing_libraries_are_named_when_not_root(monkeypatch, capsys):
    monkeypatch.setattr(sysdeps, "missing_store_libraries", lambda: ["libibverbs1"])
    monkeypatch.setattr(sysdeps.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(
        sysdeps, "run", lambda cmd, **kw: pytest.fail("ran " + str(cmd))
    )
    sysdeps.ensure_store_libraries()
    assert (
        "sudo apt-get install -y --no-install-recommends libibverbs1"
        in capsys.readouterr().err
    )


def test_this_machine_has_the_libraries():
    # NOTE: `./fork setup` ran before this test (it installs them as root; CI is root).
    assert sysdeps.missing_store_libraries() == []
