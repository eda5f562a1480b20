"""A Mooncake Store on loopback: one `mooncake_master` and one `mooncake_client`
(the node's standalone client that lends the memory), started on free
127.0.0.1 ports and stopped by pid. `./fork serve --chunk-store local` runs one
for a try-out; the tests use it through tests/store_fleet.py.

    with MooncakeFleet(workdir) as fleet:
        ... --chunk-store fleet.spec_text ...
        fleet.kill_master(); fleet.restart_master()

A missing package is an error that says what to install. Stdlib only (forktool).

NOTE: the master and the client bind their own ports on 127.0.0.1, but Mooncake
0.3.13.post1's transfer engine (inside the client, and inside every process that
connects) also listens on two ports of its own choice on every interface (its
P2P handshake and TCP data ports; MC_TCP_BIND_ADDRESS did not change that here):
docs/design/chunk-store.md, "Security". `./fork test` therefore runs the tests in a
loopback-only network namespace (loopback.py).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
INSTALL = (f"pip install {PACKAGE} (in the fork's venv: `./fork setup`) and, on Debian/"
           "Ubuntu, apt-get install -y --no-install-recommends libibverbs1 libnuma1")
# Mooncake's transfer engine takes its own RPC ports from this range: never hand one out.
_ENGINE_PORTS = range(12300, 14301)


def _binary(python: Path, name: str) -> str:
    path = python.with_name(name)
    if not path.exists():
        raise RuntimeError(f"{name} not found next to {python}: {INSTALL}")
    return str(path)


def check_installed(python: Path) -> None:
    """Raise with the install command unless Mooncake's binaries are next to
    `python` and its Python client loads there (libibverbs, libnuma)."""
    _binary(python, "mooncake_master")
    _binary(python, "mooncake_client")
    proc = subprocess.run([str(python), "-c", "import mooncake.store"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"Mooncake's Python client does not import ({last}): {INSTALL}")


def free_port(taken: set[int] = frozenset()) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ENGINE_PORTS and port not in taken:
            return port


def _die_with_parent() -> None:
    # NOTE: a test run killed outright (CI's timeout, ^C twice) must not leave a master
    # holding ports: the kernel sends SIGKILL to the child when its parent exits.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class MooncakeFleet:
    """Context manager: a master and one standalone client on loopback."""

    def __init__(self, workdir: Path | None = None, *, segment_bytes: int = 64 << 20,
                 timeout_s: float = 3.0, buffer_bytes: int = 16 << 20,
                 lookup_timeout_s: float | None = None, local_client: bool = False,
                 ready_timeout_s: float = 30.0, python: Path | None = None,
                 master_args: Sequence[str] = (), client_args: Sequence[str] = ()):
        # The venv whose Mooncake runs: its binaries sit next to its python.
        self.python = Path(python or sys.executable)
        check_installed(self.python)
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="mooncake-fleet-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.timeout_s = timeout_s
        # None: --chunk-store's default (tens of ms); tests that count store
        # hits on a loaded machine give lookups longer.
        self.lookup_timeout_s = lookup_timeout_s
        # True: vLLM connects through the node's client (Mooncake's dummy
        # client; the transfers run in the client's process).
        self.local_client = local_client
        self.buffer_bytes = buffer_bytes
        self.ready_timeout_s = ready_timeout_s
        # Extra flags, e.g. ["--client_ttl=3"] (`mooncake_master --help`).
        self.master_args = list(master_args)
        self.client_args = list(client_args)
        self.master_port = free_port()
        self.metrics_port = free_port({self.master_port})
        self.client_port = free_port({self.master_port, self.metrics_port})
        self.master: subprocess.Popen | None = None
        self.client: subprocess.Popen | None = None
        self._starts = 0

    # -- what tests use -----------------------------------------------------------

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    @property
    def spec_text(self) -> str:
        """The --chunk-store value for this fleet (this process lends no memory)."""
        text = (f"mooncake://{self.master_address}?segment=0&buffer={self.buffer_bytes}"
                f"&timeout={self.timeout_s:g}")
        if self.lookup_timeout_s is not None:
            text += f"&lookup_timeout={self.lookup_timeout_s:g}"
        # NOTE: said either way: without the key the flag means the node's client at
        # its default port, which is not this fleet's.
        client = f"127.0.0.1:{self.client_port}" if self.local_client else "none"
        return text + f"&local_client={client}"

    def kill_master(self) -> None:
        _kill(self.master)

    def stop_master(self) -> None:
        """SIGSTOP: the master keeps its sockets but answers nothing (a partition).
        Returns once every thread of it is stopped."""
        os.kill(self.master.pid, signal.SIGSTOP)
        # NOTE: kill() returns before the threads stop; a call made at once was seen
        # answered by a master thread still running on the other core.
        self._wait(lambda: _all_threads_stopped(self.master.pid), "the master stopped")

    def continue_master(self) -> None:
        os.kill(self.master.pid, signal.SIGCONT)

    def restart_master(self) -> None:
        """Kill the master and start a new one on the same port; returns once the
        client has mounted its segment again (a restarted master has forgotten
        every key: Mooncake #1336)."""
        _kill(self.master)
        self._start_master()
        if self.client is not None and self.client.poll() is None:
            self._wait(self._segment_mounted, "the client's segment mounted on the new master")

    def kill_client(self) -> None:
        _kill(self.client)

    def stop_client(self) -> None:
        """SIGSTOP the segment holder (reads of its entries hang); returns once
        every thread of it is stopped."""
        os.kill(self.client.pid, signal.SIGSTOP)
        self._wait(lambda: _all_threads_stopped(self.client.pid), "the client stopped")

    def continue_client(self) -> None:
        os.kill(self.client.pid, signal.SIGCONT)

    def start_client(self) -> None:
        self._start_client()

    def master_metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=2) as r:
            return r.read().decode()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                         for p in sorted(self.workdir.glob("*.log")))

    # -- life cycle -----------------------------------------------------------------

    def __enter__(self) -> "MooncakeFleet":
        try:
            self._start_master()
            self._start_client()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in (self.client, self.master):
            if proc is not None and proc.poll() is None:
                # NOTE: a SIGSTOPped process ignores SIGTERM until continued.
                os.kill(proc.pid, signal.SIGCONT)
            _terminate(proc)

    def _env(self) -> dict[str, str]:
        return {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        self._starts += 1
        with open(self.workdir / f"{self._starts:02d}-{name}.log", "w") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env=self._env(), preexec_fn=_die_with_parent,
                                    cwd=self.workdir)

    def _start_master(self) -> None:
        self.master = self._spawn("master", [
            _binary(self.python, "mooncake_master"), "--rpc_address=127.0.0.1",
            f"--rpc_port={self.master_port}", "--rpc_thread_num=2",
            "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
            *self.master_args])
        self._wait(lambda: _listening(self.master_port) and _listening(self.metrics_port),
                   f"mooncake_master listening on 127.0.0.1:{self.master_port}",
                   proc=self.master)

    def _start_client(self) -> None:
        self.client = self._spawn("client", [
            _binary(self.python, "mooncake_client"),
            f"--master_server_address={self.master_address}",
            "--metadata_server=P2PHANDSHAKE", "--host=127.0.0.1",
            f"--port={self.client_port}", f"--global_segment_size={self.segment_bytes}",
            "--protocol=tcp", *self.client_args])
        self._wait(lambda: _listening(self.client_port) and self._segment_mounted(),
                   f"mooncake_client's {self.segment_bytes}-byte segment mounted",
                   proc=self.client)

    def _segment_mounted(self) -> bool:
        try:
            m = re.search(r"^master_total_capacity_bytes (\d+)", self.master_metrics(), re.M)
        except OSError:
            return False
        return m is not None and int(m.group(1)) >= self.segment_bytes

    def _wait(self, ready, what: str, proc: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"waiting for {what}: the process exited with "
                                   f"{proc.returncode}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{what}: not ready within {self.ready_timeout_s:.0f} s\n"
                           f"{self.logs()}")


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            # The state follows the parenthesised command name.
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue
    return bool(states) and all(st in ("T", "t") for st in states)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _terminate(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
