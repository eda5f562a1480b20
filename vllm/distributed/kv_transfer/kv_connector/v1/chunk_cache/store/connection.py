# SPDX-License-Identifier: Apache-2.0
"""SharedStore: a process's one connection to the store, and the host memory
registered with it.

NOTE: connecting blocks, so it runs on a thread of its own, never on a path a
request waits on: until it succeeded `get()` answers None at once, and the
callers count a miss. A failed try is retried after RECONNECT_S on that
thread. But Mooncake's `setup` holds the GIL while it runs (measured: another
Python thread made no progress for the 4.4 s a setup against no master took),
so a try would stall the whole process, scheduler included: each try first
opens a plain TCP connection to the master's port (the GIL released) and calls
`setup` only when that succeeds. A master whose port accepts but which does
not answer (stopped, SIGSTOP) still costs the process one setup deadline per
try: only a client outside the process avoids that (not done, see
docs/design/chunk-store.md).

The scheduler and a worker share the connection when they run in one process;
so does a second engine of the process (the seam has no unregister, and
Mooncake refuses to register an overlapping range again: -600).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from .arena import HostArena
from .base import HostBuffer
from .spec import StoreSpec, parse_store_spec

if TYPE_CHECKING:
    from .base import ChunkStore

logger = init_logger(__name__)

# Between two tries to connect to a store that could not be reached.
RECONNECT_S = 5.0


class SharedStore:
    _lock = threading.Lock()
    _by_spec: dict[str, SharedStore] = {}

    def __init__(self, spec_text: str):
        self.spec_text = spec_text
        self.spec: StoreSpec = parse_store_spec(spec_text)
        self._store: ChunkStore | None = None
        self._lock = threading.Lock()
        # kind ("get", "put") -> the arena of that kind of call; registered
        # with the connection once, by whoever holds the lock when both exist.
        self._arenas: dict[str, HostArena] = {}
        self._registered: set[str] = set()
        self._thread: threading.Thread | None = None
        self.connect_failures = 0

    @classmethod
    def of(cls, spec_text: str) -> SharedStore:
        with cls._lock:
            shared = cls._by_spec.get(spec_text)
            if shared is None:
                shared = cls._by_spec[spec_text] = SharedStore(spec_text)
            return shared

    def use(self, store: ChunkStore) -> None:
        """Adopt a connection made elsewhere (tools, tests): registers the
        arenas made so far with it and stops nothing else from connecting."""
        with self._lock:
            self._register_locked(store)
            self._store = store
            if self._thread is None:
                self._thread = threading.current_thread()  # no connect thread

    def arena(self, kind: str, nbytes: int) -> HostArena:
        """The arena for `kind` calls; created with `nbytes` on first use (a
        later engine of this process gets the first one's size)."""
        with self._lock:
            arena = self._arenas.get(kind)
            if arena is None:
                arena = self._arenas[kind] = HostArena(nbytes)
            if self._store is not None:
                self._register_locked(self._store)
            return arena

    def get(self) -> ChunkStore | None:
        """The connection, or None (at once) while it is not made yet."""
        store = self._store
        if store is None:
            self.start_connecting()
        return store

    def start_connecting(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._connect_loop, name="chunk-store-connect", daemon=True)
                self._thread.start()

    def wait_connected(self, timeout_s: float) -> bool:
        """Tests and tools: wait until connected (False after timeout_s)."""
        self.start_connecting()
        t_end = time.monotonic() + timeout_s
        while self._store is None and time.monotonic() < t_end:
            time.sleep(0.05)
        return self._store is not None

    def _connect_loop(self) -> None:
        from .mooncake import MooncakeChunkStore

        while True:
            try:
                self._probe_master()
                store = MooncakeChunkStore.connect(self.spec)
                with self._lock:
                    # NOTE: published only once its memory is registered: a call is
                    # never given memory the client does not know.
                    self._register_locked(store)
                    self._store = store
            except Exception as e:  # noqa: BLE001 - any failure: try again later
                self.connect_failures += 1
                logger.warning("chunk store: cannot connect to %s (%s); entries are "
                               "computed locally until it can be reached (next try in "
                               "%.0f s)", self.spec_text, e, RECONNECT_S)
                time.sleep(RECONNECT_S)
                continue
            logger.info("chunk store: connected to %s", self.spec_text)
            return

    def _probe_master(self) -> None:
        """OSError unless the master's port accepts a TCP connection."""
        timeout = min(1.0, self.spec.timeout_s)
        with socket.create_connection((self.spec.master_host, self.spec.master_port),
                                      timeout=timeout):
            pass

    def _register_locked(self, store: ChunkStore) -> None:
        for kind, arena in self._arenas.items():
            if kind not in self._registered:
                store.register_buffer(HostBuffer(arena.ptr, arena.nbytes))
                self._registered.add(kind)
