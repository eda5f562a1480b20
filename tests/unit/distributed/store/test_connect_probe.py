"""Issue 50, finding 8: the connect probe against a stopped (SIGSTOP) peer.

A real process listens where the store's master should be and, while it runs,
does what Mooncake's master and mooncake_client do with a connection whose first
bytes are no RPC header: it closes it. Stopped, the kernel still completes TCP
handshakes for it. Before: the probe (a TCP connect) passed, Mooncake's `setup`
then held the GIL for about the spec's timeout, every RECONNECT_S, and every other
thread of the engine's process froze (measured here: a 4.1 s stall at timeout=4).
Now an engine-side call stays quick while the connect thread keeps failing.
The bound is half the configured timeout: far above a call's normal cost (micro-
seconds), far below the stall a setup against the stopped peer makes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.connection import (
    SharedStore,
)

TIMEOUT_S = 4.0

LISTENER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0))
s.listen(64)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.recv(64)
    c.close()
"""


@pytest.fixture
def listener():
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True
    )
    port = int(proc.stdout.readline())
    yield proc, port
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_the_probe_needs_the_peers_answer(listener):
    proc, port = listener
    shared = SharedStore(
        f"mooncake://127.0.0.1:{port}?timeout={TIMEOUT_S:g}&local_client=none"
    )
    shared._probe()  # running: it answers (closes)
    os.kill(proc.pid, signal.SIGSTOP)
    with pytest.raises(OSError, match="did not answer"):
        shared._probe()


def test_a_stopped_master_never_stalls_the_engines_calls(listener):
    proc, port = listener
    os.kill(proc.pid, signal.SIGSTOP)
    shared = SharedStore(
        f"mooncake://127.0.0.1:{port}?timeout={TIMEOUT_S:g}&local_client=none"
    )
    worst = 0.0
    shared.start_connecting()
    stop = threading.Event()
    guard = threading.Timer(60, stop.set)
    guard.start()
    try:
        # Two failed tries (the second RECONNECT_S after the first), each call of
        # the engine's timed around it.
        while shared.connect_failures < 2 and not stop.is_set():
            t0 = time.monotonic()
            assert shared.get() is None
            time.sleep(0.001)
            worst = max(worst, time.monotonic() - t0)
    finally:
        guard.cancel()
    assert shared.connect_failures >= 2, "the connect thread made no second try in 60 s"
    assert worst < TIMEOUT_S / 2, (
        f"an engine-side call took {worst:.2f} s while the store's master was stopped "
        f"(timeout {TIMEOUT_S:g} s): the connect thread held the GIL"
    )
