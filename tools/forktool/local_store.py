"""`./fork serve --chunk-store local`: a try-out of the fleet tier on one machine.

Starts a Mooncake master and a standalone client (which lends the memory) on free
127.0.0.1 ports, hands vllm serve their spec in place of `local`, and stops them
when the server exits (Ctrl-C included). Logs: .cache/store-local/.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from .env import runtime_env
from .mooncake_fleet import MooncakeFleet
from .paths import Paths
from .progress import ToolError, say

FLAG = "--chunk-store"
# Memory the local client lends to the store (FORK_STORE_SEGMENT_MB overrides it).
DEFAULT_SEGMENT_MB = 512


def wants_local_store(vllm_args: list[str]) -> bool:
    return _local_index(vllm_args) is not None


def _local_index(argv: list[str]) -> int | None:
    for i, arg in enumerate(argv):
        if arg == f"{FLAG}=local" or (arg == FLAG and i + 1 < len(argv)
                                      and argv[i + 1] == "local"):
            return i
    return None


def with_spec(argv: list[str], spec_text: str) -> list[str]:
    """`argv` with `--chunk-store local` replaced by the local store's spec."""
    i = _local_index(argv)
    if i is None:
        return list(argv)
    width = 1 if argv[i].startswith(f"{FLAG}=") else 2
    return [*argv[:i], FLAG, spec_text, *argv[i + width:]]


def serve_with_local_store(paths: Paths, python: str, argv: list[str],
                           offline: bool = True) -> int:
    """Run `argv` (vllm serve) against a local master and client; `offline=False` leaves
    the hub switched on, for a model that may have to be downloaded (cli.ServeCommand)."""
    segment_mb = int(os.environ.get("FORK_STORE_SEGMENT_MB", DEFAULT_SEGMENT_MB))
    try:
        # NOTE: through the node's client (Mooncake's dummy client): the
        # transfers run in mooncake_client's process, so a crash there is a
        # miss in vLLM, not a dead server (docs/design/chunk-store.md).
        fleet = MooncakeFleet(paths.cache / "store-local", segment_bytes=segment_mb << 20,
                              timeout_s=5.0, python=Path(python), local_client=True)
    except RuntimeError as e:
        raise ToolError(str(e)) from None
    with fleet:
        say(f"local chunk store: mooncake_master on {fleet.master_address} (pid "
            f"{fleet.master.pid}), mooncake_client lending {segment_mb} MB (pid "
            f"{fleet.client.pid}); logs in {fleet.workdir}")
        argv = with_spec(argv, fleet.spec_text)
        runtime = runtime_env(paths, offline=offline)
        environ = {**runtime, **os.environ, "PATH": runtime["PATH"]}
        say("running: " + " ".join(argv))
        server = subprocess.Popen(argv, env=environ)
        # NOTE: a SIGTERM to ./fork takes the same way out as Ctrl-C: the server first,
        # then the store (which would otherwise die with us, leaving the server orphaned).
        signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            return server.wait()
        except KeyboardInterrupt:
            server.send_signal(signal.SIGINT)
            try:
                return server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                return server.wait()
        finally:
            if server.poll() is None:
                server.terminate()
                server.wait(60)
            say("local chunk store: stopping the master and the client")


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
