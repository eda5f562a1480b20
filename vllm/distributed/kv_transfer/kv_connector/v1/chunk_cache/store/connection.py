# SPDX-License-Identifier: Apache-2.0
"""SharedStore: a process's one connection to the store, and the host memory
registered with it (one arena for reads, one for writes).

NOTE: connecting blocks, so it runs on a thread of its own, never on a path a
request waits on: until it succeeded `get()` answers None at once, and the
callers count a miss. A failed try is retried after RECONNECT_S on that
thread. But Mooncake's `setup` holds the GIL while it runs (measured: another
Python thread made no progress for the 4.4 s a setup against no master took),
so a try would stall the whole process, scheduler included: each try first
probes the address it sets up against (the GIL released) and calls `setup`
only when the process there answers (`_probe`: a TCP connect alone passes
against a stopped process).

Two ways to connect (StoreSpec.local_client):
- in process (default): Mooncake's client runs here; the arenas are plain
  (pinned on a GPU host) memory, registered once connected;
- through the node's mooncake_client (`local_client=host:port`): this process
  runs Mooncake's dummy client only, and the node's client makes every
  transfer. Its transfers can use only the shared memory the dummy client
  maps, so the arenas are carved from it once connected (until then there are
  none: reads and writes are misses). A crash in Mooncake's transfer code is
  then a miss here, not a dead engine, and on one node a read is a copy
  through shared memory.

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

from .arena import ALIGN, HostArena
from .base import HostBuffer
from .spec import StoreSpec, parse_store_spec

if TYPE_CHECKING:
    from .base import ChunkStore

logger = init_logger(__name__)

# Between two tries to connect to a store that could not be reached.
RECONNECT_S = 5.0
KINDS = ("get", "put")
# What the connect probe sends: no RPC header, so the peer closes the connection.
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
        """Transfers through the node's client (arenas in its shared memory)."""
        return self.spec.local_client is not None

    def want_arenas(self, nbytes: int) -> None:
        """A worker needs a read and a write arena of `nbytes` each: made now
        in process, or from the shared memory once connected. A later engine
        of this process gets the first one's."""
        with self._lock:
            if self._arena_bytes:
                return
            self._arena_bytes = nbytes
            if not self.shared_memory:
                for kind in KINDS:
                    self._arenas[kind] = HostArena(nbytes)
                if self._store is not None:
                    self._register_locked(self._store)
            elif self._store is not None:
                self._arenas = self._carved(self._store)

    def want_pool(self, buffers: list[HostBuffer]) -> None:
        """A worker's chunk pool (host tensors): registered with the client in
        this process, now or once connected, so that a read lands in the pool's
        rows with no arena between (issue 39, finding 9). Not through the
        node's client: its transfers reach only the shared memory it maps."""
        if self.shared_memory:
            return
        with self._lock:
            self._pool_wanted.extend(b for b in buffers if b not in self._pool_wanted)
            if self._store is not None:
                self._register_pool_locked(self._store)

    def pool_ready(self, buffers: list[HostBuffer]) -> bool:
        """Every one of `buffers` is registered with the connection."""
        return bool(buffers) and all(b in self._pool_registered for b in buffers)

    def arena(self, kind: str) -> HostArena | None:
        """The arena of `kind` calls, None while there is none yet."""
        return self._arenas.get(kind)

    def use(self, store: ChunkStore) -> None:
        """Adopt a connection made elsewhere (tools, tests): registers the
        arenas made so far with it and stops nothing else from connecting."""
        with self._lock:
            self._register_locked(store)
            self._store = store
            if self._thread is None:
                self._thread = threading.current_thread()  # no connect thread

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
                    target=self._connect_loop, name="chunk-store-connect", daemon=True
                )
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
            except Exception as e:  # noqa: BLE001 - any failure: try again later
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
        """OSError unless the process at the address setup goes to answers.

        NOTE (issue 50, finding 8): a TCP connect alone passes against a stopped
        (SIGSTOP) master or node client: the kernel completes the handshake. Then
        `setup` held the GIL for about `timeout`, every RECONNECT_S, and the whole
        process, scheduler included, froze. So the probe sends a header no RPC
        server accepts and waits for the peer's own answer: Mooncake's master and
        mooncake_client close such a connection at once (seen with both); a
        stopped process says nothing, and the probe fails after its wait with the
        GIL released all along."""
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
        """Make `store` the connection: its arenas (carved from its shared
        memory through the node's client) and every buffer registered with it,
        then published. NOTE (issue 50, finding 7): what is registered with, or
        carved from, a client belongs to that client alone. Registrations are
        recorded for `store` from scratch, and carved arenas are published
        only with it, so a try that fails half-way (`_discard`) leaves nothing
        of its client behind: before, an arena registered with a discarded
        client stayed in `_registered` and was never registered with the next
        one (every read into it failed), and arenas carved from a discarded
        dummy client's shared memory were kept for the next."""
        self._registered = set()
        self._pool_registered = set()
        if self.shared_memory and not self._arenas:
            arenas = self._carved(store)
            self._register_arenas_locked(store, arenas)
            # NOTE: published only once registered: a call is never given
            # memory the client does not know.
            self._arenas = arenas
        else:
            self._register_arenas_locked(store, self._arenas)
        self._register_pool_locked(store)
        self._store = store

    def _discard(self, store: ChunkStore) -> None:
        """A client whose set-up failed after it connected: nothing of it stays
        (its registrations, arenas from its shared memory), and it is closed."""
        with self._lock:
            if self._store is store:
                self._store = None
            self._registered = set()
            self._pool_registered = set()
            if self.shared_memory:
                self._arenas = {}
        try:
            store.close()
        except Exception as e:  # noqa: BLE001 - it is dropped either way
            logger.warning("chunk store: closing a client whose set-up failed: %s", e)

    def _carved(self, store: ChunkStore) -> dict[str, HostArena]:
        """The arenas, from the dummy client's shared memory ({} if none was
        asked for yet or there is no room)."""
        if not self._arena_bytes:
            return {}
        try:
            return {
                kind: HostArena(
                    self._arena_bytes, ptr=store.alloc_host(self._arena_bytes)
                )
                for kind in KINDS
            }
        except RuntimeError as e:
            # NOTE: a connection made before any worker asked (its pool too small):
            # the store stays without arenas, every read and write a miss.
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

    def _register_locked(self, store: ChunkStore) -> None:
        self._register_arenas_locked(store, self._arenas)
        self._register_pool_locked(store)

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
                # NOTE: a call still running may write into the old range (an
                # earlier engine's read given up on): not this pool's reads.
                logger.warning(
                    "chunk store: this worker's pool reuses memory an "
                    "earlier engine's pool lent to a store call that has not "
                    "returned; its reads go through host memory of their own"
                )
                continue
            try:
                # NOTE: two live pools never overlap: memory registered for an
                # earlier engine's pool and now this one's was freed with it
                # (Mooncake refuses a range overlapping a registered one).
                for old in stale:
                    store.unregister_buffer(old)
                    self._pool_registered.discard(old)
                    self._pool_wanted.remove(old)
                store.register_buffer(buffer)
            except RuntimeError as e:
                # NOTE: Mooncake refused (or did not answer): that worker reads
                # through the arena instead.
                logger.warning(
                    "chunk store: %s; reads go through host memory of their own", e
                )
                continue
            self._pool_registered.add(buffer)
