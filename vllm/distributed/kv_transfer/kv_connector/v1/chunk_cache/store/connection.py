# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SharedStore: a process's one connection to the store, and the host memory
registered with it (one arena for reads, one for writes).

Connecting blocks, so it runs on a thread of its own: until it succeeded
`get()` answers None at once and callers count a miss; a failed try is
retried after RECONNECT_S. Mooncake's `setup` holds the GIL while it runs, so
each try first probes the address (`_probe`, the GIL released).

With `local_client` (StoreSpec) this process runs Mooncake's dummy client and
the node's client makes every transfer; those reach only the dummy client's
shared memory, so the arenas are carved from it once connected. Otherwise the
arenas are plain (pinned) memory registered with the in-process client.

The scheduler, the workers and later engines of a process share the
connection: Mooncake refuses to register an overlapping range again (-600).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from .arena import ALIGN, HostArena
from .base import HostBuffer
from .spec import StoreSpec, parse_store_spec

if TYPE_CHECKING:
    from .base import ChunkStore

logger = init_logger(__name__)

# Between two tries to connect to a store that could not be reached.
RECONNECT_S = 5.0
KINDS = ("get", "put")
# What the probe sends: no RPC header, so the peer closes the connection.
PROBE_BYTES = bytes(64)


class SharedStore:
    _lock = threading.Lock()
    _by_spec: dict[str, SharedStore] = {}

    def __init__(self, spec_text: str):
        self.spec_text = spec_text
        self.spec: StoreSpec = parse_store_spec(spec_text)
        self._store: ChunkStore | None = None
        self._lock = threading.Lock()
        # The size each arena should have (0: no worker asked for arenas).
        self._arena_bytes = 0
        self._arenas: dict[str, HostArena] = {}
        self._registered: set[str] = set()
        # The chunk pool's host tensors of each worker of this process, and
        # which of them the connection knows (reads land in them directly).
        self._pool_wanted: list[HostBuffer] = []
        self._pool_registered: set[HostBuffer] = set()
        self._thread: threading.Thread | None = None
        self.connect_failures = 0

    @classmethod
    def of(cls, spec_text: str) -> SharedStore:
        with cls._lock:
            shared = cls._by_spec.get(spec_text)
            if shared is None:
                shared = cls._by_spec[spec_text] = SharedStore(spec_text)
            return shared

    @property
    def shared_memory(self) -> bool:
        return self.spec.local_client is not None

    def want_arenas(self, nbytes: int) -> None:
        """A read and a write arena of `nbytes` each (a later engine of the
        process gets the first one's)."""
        with self._lock:
            if self._arena_bytes:
                return
            self._arena_bytes = nbytes
            if not self.shared_memory:
                self._arenas = {kind: HostArena(nbytes) for kind in KINDS}
            if self._store is not None:
                self._arm_locked(self._store)

    def want_pool(self, buffers: list[HostBuffer]) -> None:
        """A worker's host pool tensors, registered with an in-process client
        so that reads land in the pool's rows with no arena between."""
        if self.shared_memory:
            return
        with self._lock:
            self._pool_wanted.extend(b for b in buffers if b not in self._pool_wanted)
            if self._store is not None:
                self._register_pool_locked(self._store)

    def pool_ready(self, buffers: list[HostBuffer]) -> bool:
        return bool(buffers) and all(b in self._pool_registered for b in buffers)

    def arena(self, kind: str) -> HostArena | None:
        return self._arenas.get(kind)

    def use(self, store: ChunkStore) -> None:
        """Adopt a connection made elsewhere (tools, tests) as the connect loop
        adopts its own; no connect thread is started after this."""
        with self._lock:
            self._adopt_locked(store)
            if self._thread is None:
                self._thread = threading.current_thread()  # no connect thread

    def get(self) -> ChunkStore | None:
        store = self._store
        if store is None:
            self.start_connecting()
        return store

    def start_connecting(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._connect_loop, name="chunk-store-connect", daemon=True
                )
                self._thread.start()

    def wait_connected(self, timeout_s: float) -> bool:
        self.start_connecting()
        t_end = time.monotonic() + timeout_s
        while self._store is None and time.monotonic() < t_end:
            time.sleep(0.05)
        return self._store is not None

    def _connect_loop(self) -> None:
        from .mooncake import MooncakeChunkStore

        while True:
            try:
                self._probe()
                with self._lock:
                    pool = len(KINDS) * (self._arena_bytes + 2 * ALIGN)
                store = MooncakeChunkStore.connect(self.spec, shared_pool_bytes=pool)
                try:
                    with self._lock:
                        self._adopt_locked(store)
                except BaseException:
                    self._discard(store)
                    raise
            except Exception as e:  # any failure: try again later
                self.connect_failures += 1
                logger.warning(
                    "chunk store: cannot connect to %s (%s); entries are "
                    "computed locally until it can be reached (next try in "
                    "%.0f s)",
                    self.spec_text,
                    e,
                    RECONNECT_S,
                )
                time.sleep(RECONNECT_S)
                continue
            logger.info("chunk store: connected to %s", self.spec_text)
            return

    def _probe(self) -> None:
        """OSError unless the process `setup` would talk to answers. A TCP
        connect alone passes against a stopped (SIGSTOP) process, and `setup`
        would then hold the GIL for its timeout; Mooncake's master and client
        close a connection sending no RPC header at once, a stopped one never."""
        address = self.spec.local_client or self.spec.master_address
        host, _, port = address.rpartition(":")
        wait = min(1.0, self.spec.timeout_s)
        with socket.create_connection((host, int(port)), timeout=wait) as sock:
            sock.sendall(PROBE_BYTES)
            try:
                sock.recv(64)  # b"" (closed) or any bytes: the process answered
            except TimeoutError as e:
                raise OSError(
                    f"{address} accepted a connection but did not answer "
                    f"within {wait:g} s (a stopped process?)"
                ) from e
            except ConnectionResetError:
                pass  # reset by the peer: it answered

    def _adopt_locked(self, store: ChunkStore) -> None:
        """Make `store` the connection, its arenas carved and every buffer
        registered first. What is registered with, or carved from, a client is
        that client's alone: recorded from scratch and published only with
        it, so a try that fails half-way (`_discard`) leaves nothing behind."""
        self._registered = set()
        self._pool_registered = set()
        self._arm_locked(store)
        self._register_pool_locked(store)
        self._store = store

    def _arm_locked(self, store: ChunkStore) -> None:
        if self.shared_memory and not self._arenas:
            arenas = self._carved(store)
            self._register_arenas_locked(store, arenas)
            # Published once registered: no call gets memory the client lacks.
            self._arenas = arenas
        else:
            self._register_arenas_locked(store, self._arenas)

    def _discard(self, store: ChunkStore) -> None:
        """Drop a client whose set-up failed after it connected, and close it."""
        with self._lock:
            if self._store is store:
                self._store = None
            self._registered = set()
            self._pool_registered = set()
            if self.shared_memory:
                self._arenas = {}
        try:
            store.close()
        except Exception as e:  # dropped either way
            logger.warning("chunk store: closing a client whose set-up failed: %s", e)

    def _carved(self, store: ChunkStore) -> dict[str, HostArena]:
        """The arenas, from the client's shared memory ({}: none asked for, or
        no room)."""
        if not self._arena_bytes:
            return {}
        try:
            nbytes = self._arena_bytes
            return {kind: HostArena(nbytes, store.alloc_host(nbytes)) for kind in KINDS}
        except RuntimeError as e:
            # E.g. connected before any worker asked (its pool too small).
            logger.error(
                "chunk store: %s; store reads and writes are off in this process", e
            )
            return {}

    def _register_arenas_locked(
        self, store: ChunkStore, arenas: dict[str, HostArena]
    ) -> None:
        for kind, arena in arenas.items():
            if kind not in self._registered:
                store.register_buffer(HostBuffer(arena.ptr, arena.nbytes))
                self._registered.add(kind)

    def _register_pool_locked(self, store: ChunkStore) -> None:
        if not store.scatters:
            return
        for buffer in list(self._pool_wanted):
            if buffer in self._pool_registered:
                continue
            stale = [
                b
                for b in self._pool_registered
                if b.ptr < buffer.ptr + buffer.nbytes and buffer.ptr < b.ptr + b.nbytes
            ]
            if stale and not store.idle():
                # A call still running may write into the old range.
                logger.warning(
                    "chunk store: this worker's pool reuses memory an "
                    "earlier engine's pool lent to a store call that has not "
                    "returned; its reads go through host memory of their own"
                )
                continue
            try:
                # Two live pools never overlap: a stale range was freed with
                # an earlier engine's pool.
                for old in stale:
                    store.unregister_buffer(old)
                    self._pool_registered.discard(old)
                    self._pool_wanted.remove(old)
                store.register_buffer(buffer)
            except RuntimeError as e:  # refused: that worker reads via the arena
                logger.warning(
                    "chunk store: %s; reads go through host memory of their own", e
                )
                continue
            self._pool_registered.add(buffer)
