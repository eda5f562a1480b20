"""Issue 50, finding 1's last edge: Mooncake's get returns (failed) while its
transport still writes.

Seen in the in-process soak (tests/e2e/test_chunk_store_soak.py, reads into
the pool): engine A's read hung (the segment holder stopped), Mooncake gave the
batch up after its 60 s transfer wait (TRANSFER_FAIL) and returned, so the
call's `on_release` ran and A's pool was let go; A was closed. But the TCP
transport kept retrying the slices on new connections, and the one open when
the holder resumed wrote the value into A's freed pool: a heap corruption in
engine B ("corrupted size vs. prev_size"). With A's pool tensors kept past the
release (a debugging run), the bytes of A's pool changed after A was closed,
and B served 48 of 48.

The double below is Mooncake's client under MooncakeChunkStore (its lanes and
codes are the code under test): its first multi-buffer get blocks past the
read deadline and past the engine's close, returns TRANSFER_FAIL, and a
"transport" thread writes into the buffers it was given afterwards.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
import weakref

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store import mooncake
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (
    EntryFetch,
    EntryPut,
    FetchOutcome,
    StoreStep,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.spec import (
    parse_store_spec,
)

from tests.unit.distributed.store.test_store_transfers import (
    _reports,
    drain_puts,
    entry,
    rows_of,
    small_pool,
    step_until,
    transfers,
    wait_identity,
)

_TRANSFER_FAIL = -800
# NOTE: reads into the pool rows (direct_reads): what these tests are about.
SPEC = (
    "mooncake://127.0.0.1:1?read_timeout=0.05&timeout=0.05&arena=1MB&local_client=none"
    "&direct_reads=1"
)
LATE = 0x7F


class FailedThenLateClient:
    """Mooncake's client, in memory. The first multi-buffer get blocks until
    `go`, then answers TRANSFER_FAIL for every key, and its transport writes
    LATE into every buffer it was given once `land` is set (after the call
    returned, as Mooncake's retried TCP sessions did)."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.block_first = True
        self.entered = threading.Event()
        self.go = threading.Event()
        self.land = threading.Event()
        self.landed = threading.Event()

    def register_buffer(self, ptr, nbytes):
        return 0

    def unregister_buffer(self, ptr):
        return 0

    def batch_is_exist(self, keys):
        return [int(k in self.values) for k in keys]

    def batch_put_from(self, keys, ptrs, sizes):
        for k, p, n in zip(keys, ptrs, sizes):
            self.values.setdefault(k, ctypes.string_at(p, n))
        return [0] * len(keys)

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
        if self.block_first:
            self.block_first = False
            self.entered.set()
            assert self.go.wait(30)
            spans = [(p, n) for ps, ns in zip(ptrs, sizes) for p, n in zip(ps, ns)]

            def transport():
                assert self.land.wait(30)
                for p, n in spans:
                    ctypes.memset(p, LATE, n)
                self.landed.set()

            threading.Thread(target=transport, daemon=True).start()
            return [_TRANSFER_FAIL] * len(keys)
        out = []
        for k, ps, ns in zip(keys, ptrs, sizes):
            v = self.values.get(k)
            if v is None:
                out.append(-704)
                continue
            off = 0
            for p, n in zip(ps, ns):
                ctypes.memmove(p, v[off : off + n], n)
                off += n
            out.append(len(v))
        return out

    def close(self):
        return 0


def _reader_with_a_failed_read(monkeypatch):
    # NOTE: what this test's retired gets hold is dropped with the test.
    monkeypatch.setattr(mooncake, "_RETIRED", [], raising=False)
    client = FailedThenLateClient()
    store = mooncake.MooncakeChunkStore(parse_store_spec(SPEC), client)
    src = small_pool(seed=1)
    writer = transfers(SPEC, src, store=store)
    wait_identity(writer)
    a = entry([1] + list(range(10, 40)))
    writer.on_step(StoreStep(epoch=0, puts=[EntryPut(a, (0, 1))]))
    drain_puts(writer)
    assert client.values
    dst = small_pool(seed=2)
    reader = transfers(SPEC, dst, store=store)
    wait_identity(reader)
    assert reader.reads_into_pool()
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f1", a, (5, 6))]))
    assert client.entered.wait(10)
    assert step_until(reader, "f1") is FetchOutcome.TIMEOUT
    assert reader._rows_held.keys() == {"f1"}
    return client, store, reader, dst, a


def test_a_closed_engines_pool_outlives_a_failed_gets_late_transport_writes(
    monkeypatch,
):
    """The engine is closed while its read hangs; Mooncake then returns the
    get as failed, and its transport writes into the pool afterwards. Before,
    the call's return released the pool (the lease's last hold): it was freed
    and the write landed in freed memory. Now a failed get's memory is never
    released in this process (the transport's retries have no bound)."""
    client, store, reader, dst, _ = _reader_with_a_failed_read(monkeypatch)
    pool = weakref.ref(dst["layers.0.k"])
    assert reader.close(timeout_s=0.2) == 1  # the call holds the pool
    del reader, dst
    gc.collect()
    assert pool() is not None
    client.go.set()  # Mooncake gives the get up: TRANSFER_FAIL, and it returns
    assert store.wait_idle(10)
    gc.collect()
    assert pool() is not None, (
        "the pool was freed when the failed get returned, while Mooncake's transport "
        "may still write into it"
    )
    client.land.set()
    assert client.landed.wait(10)
    late = pool()
    assert late is not None
    assert (
        late.view(torch.uint8)[5 * 16 : 5 * 16 + 30] == LATE
    ).all()  # landed in the pool
    del late
    assert store.stats.gets_retired == 1
    time.sleep(0.2)
    gc.collect()
    assert pool() is not None


def test_a_failed_gets_rows_are_never_returned(monkeypatch):
    """In a live engine the rows a failed get was given are not handed to
    another entry when the call returns: its transport's late write would land
    in rows served unchecked. They stay lent (the scheduler writes them off at
    held_limit), and the connection serves on, exact, in other rows."""
    client, store, reader, dst, a = _reader_with_a_failed_read(monkeypatch)
    untouched = rows_of(dst, (1, 2), 30)
    client.go.set()
    assert store.wait_idle(10)
    assert _reports(reader, 3).rows_returned == {}, (
        "rows returned while the transport writes"
    )
    client.land.set()
    assert client.landed.wait(10)
    late = rows_of(dst, (5, 6), 30)
    assert all((v.view(torch.uint8) == LATE).all() for v in late.values())
    assert _reports(reader, 3).rows_returned == {}
    assert reader._rows_held.keys() == {"f1"} and reader.lent_bytes() > 0
    for name, rows in rows_of(dst, (1, 2), 30).items():
        assert torch.equal(rows, untouched[name]), name
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f2", a, (1, 2))]))
    assert step_until(reader, "f2") is FetchOutcome.OK


def test_a_get_that_transferred_everything_is_released_when_it_returns(monkeypatch):
    """A get Mooncake completed (or found absent) is released when it returns."""
    monkeypatch.setattr(mooncake, "_RETIRED", [], raising=False)
    client = FailedThenLateClient()
    client.block_first = False
    store = mooncake.MooncakeChunkStore(parse_store_spec(SPEC), client)
    writer = transfers(SPEC, small_pool(seed=1), store=store)
    wait_identity(writer)
    a = entry([1] + list(range(10, 40)))
    writer.on_step(StoreStep(epoch=0, puts=[EntryPut(a, (0, 1))]))
    drain_puts(writer)
    reader = transfers(SPEC, small_pool(seed=2), store=store)
    wait_identity(reader)
    reader.on_step(
        StoreStep(
            epoch=0,
            fetches=[
                EntryFetch("f", a, (1, 2)),
                EntryFetch("g", entry([1, 5, 6, 7]), (3,)),
            ],
        )
    )
    assert step_until(reader, "f") is FetchOutcome.OK
    _reports(reader, 2)
    assert reader.lent_bytes() == 0 and store.stats.gets_retired == 0
