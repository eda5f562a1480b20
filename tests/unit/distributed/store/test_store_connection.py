# SPDX-License-Identifier: Apache-2.0
"""SharedStore's connect loop when a try fails after its client connected
(issue 50, finding 7).

The clients are doubles that behave as Mooncake's do where it matters here: a
transfer reaches only memory registered with that client (in process), or
only that dummy client's own shared memory (through the node's client);
anything else fails (an error code, as Mooncake answers). The first client
refuses its second `register_buffer`; the connect loop then builds a second
one, and a put and a read through a worker's StoreTransfers must work with it.
"""

from __future__ import annotations

import ctypes

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store import connection
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.base import (
    ChunkStore,
    HostBuffer,
    Presence,
    StoreCode,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.connection import (
    SharedStore,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (
    EntryFetch,
    EntryPut,
    FetchOutcome,
    StoreStep,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.transfers import (
    StoreTransfers,
)

from tests.unit.distributed.store.test_store_transfers import (
    drain_puts,
    entry,
    rows_of,
    small_pool,
    step_until,
    wait_identity,
)

# An address no other test's store uses (nothing listens: _probe is patched).
MASTER = "127.0.0.1:47231"


class Client(ChunkStore):
    """One Mooncake client (a shared `values` dict stands for the store)."""

    scatters = True

    def __init__(self, values: dict, shared_bytes: int = 0, fail_register: int = 0):
        self.values = values
        self.fail_register = fail_register  # the n-th register_buffer raises
        self.registers = 0
        self.registered: list[HostBuffer] = []
        self.closed = False
        self.memory = (ctypes.c_uint8 * shared_bytes)() if shared_bytes else None
        self.used = 0

    # -- set-up
    def alloc_host(self, nbytes: int) -> int:
        assert self.memory is not None
        if self.used + nbytes > len(self.memory):
            raise RuntimeError("no room in the shared memory")
        ptr = ctypes.addressof(self.memory) + self.used
        self.used += nbytes + 64
        return ptr

    def register_buffer(self, buffer):
        self.registers += 1
        if self.registers == self.fail_register:
            raise RuntimeError("register_buffer failed (-1)")
        self.registered.append(buffer)

    def unregister_buffer(self, buffer):
        self.registered.remove(buffer)

    def close(self):
        self.closed = True

    # -- transfers
    def _reaches(self, b: HostBuffer) -> bool:
        if self.closed:
            return False
        if self.memory is not None:
            base = ctypes.addressof(self.memory)
            return base <= b.ptr and b.ptr + b.nbytes <= base + len(self.memory)
        return any(
            r.ptr <= b.ptr and b.ptr + b.nbytes <= r.ptr + r.nbytes
            for r in self.registered
        )

    def batch_exists(self, keys):
        return [Presence.PRESENT if k in self.values else Presence.ABSENT for k in keys]

    def batch_get_into(self, keys, buffers, on_release=lambda: None):
        return self.batch_get_into_parts(keys, [[b] for b in buffers], on_release)

    def batch_get_into_parts(self, keys, parts, on_release=lambda: None):
        out = []
        for key, buffers in zip(keys, parts):
            value = self.values.get(key)
            if not all(map(self._reaches, buffers)):
                out.append(StoreCode.ERROR)
            elif value is None:
                out.append(StoreCode.ABSENT)
            elif len(value) != sum(b.nbytes for b in buffers):
                out.append(StoreCode.TOO_LARGE)
            else:
                off = 0
                for b in buffers:
                    ctypes.memmove(b.ptr, value[off : off + b.nbytes], b.nbytes)
                    off += b.nbytes
                out.append(len(value))
        on_release()
        return out

    def batch_put_from(self, keys, buffers, on_release=lambda: None):
        out = []
        for key, b in zip(keys, buffers):
            if not self._reaches(b):
                out.append(StoreCode.ERROR)
                continue
            self.values.setdefault(key, ctypes.string_at(b.ptr, b.nbytes))
            out.append(0)
        on_release()
        return out


@pytest.mark.parametrize(
    "local_client", [False, True], ids=["in-process", "node-client"]
)
def test_a_connect_that_failed_half_way_leaves_nothing_of_its_client(
    monkeypatch, local_client
):
    values: dict = {}
    shared_bytes = 8 << 20 if local_client else 0
    # The first client's second register_buffer fails (the put arena, after the
    # get arena was registered with it).
    clients = [
        Client(values, shared_bytes, fail_register=2),
        Client(values, shared_bytes),
    ]
    made = []

    def connect(spec, shared_pool_bytes=0):
        # NOTE: only this test's SharedStore: connect threads of earlier tests
        # (retrying an unreachable store) call the patched method too.
        if spec.master_address != MASTER:
            raise RuntimeError(f"not this test's store: {spec.master_address}")
        made.append(clients[len(made)])
        return made[-1]

    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store import mooncake

    monkeypatch.setattr(mooncake.MooncakeChunkStore, "connect", staticmethod(connect))
    monkeypatch.setattr(SharedStore, "_probe", lambda self: None)  # no network
    monkeypatch.setattr(connection, "RECONNECT_S", 0.01)

    spec = f"mooncake://{MASTER}?arena=1MB" + (
        "" if local_client else "&local_client=none"
    )
    shared = SharedStore(spec)
    from torch import nn

    from tests.unit.distributed.store.test_store_transfers import rank

    src = small_pool(seed=1)
    t = StoreTransfers(
        rank(), shared, nn.Linear(1, 1), src, "f32", fingerprint=lambda m: "w"
    )
    assert t.shared_ready(10)
    wait_identity(t)
    assert made == clients and shared.connect_failures == 1
    # Everything this process uses with the second client is that client's.
    assert all(
        clients[1]._reaches(HostBuffer(a.ptr, a.nbytes))
        for a in (t.get_arena, t.put_arena)
    ), "an arena the client cannot reach"

    a = entry([1] + list(range(10, 40)))
    t.on_step(StoreStep(epoch=0, puts=[EntryPut(a, (0, 1))]))
    drain_puts(t)
    assert t.counters.get("store_puts") == 1, t.counters
    t.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f", a, (4, 5))]))
    assert step_until(t, "f") is FetchOutcome.OK, t.counters
    got, want = rows_of(src, (4, 5), 30), rows_of(src, (0, 1), 30)
    assert all((got[n] == want[n]).all() for n in got)
    # The discarded client was closed (its connection and memory released).
    assert clients[0].closed and not clients[1].closed
