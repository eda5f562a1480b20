"""Issue 50: a get Mooncake fails in transfer costs an arena span, never pool rows.

Its transport may still write into what the get was given after the call
returned (test_late_transport_writes.py), so a failed get is retired: its
memory is never given to anything again. Reads land in the get arena by
default (the spec's `direct_reads=1` reads into the pool rows), so what is
retired is a span of the arena:

- in process (`local_client=none`): before, the read went into the pool rows,
  which then stayed lent until `held_limit` wrote them off and shrank the pool
  for good (the in-process soak stalled, or refused 158 of 500 with
  held_limit=30). Now the scheduler is told of no lent rows, the document is
  computed at once, and the pool keeps its size;
- through the node's client (`local_client=host:port`): before, the failed
  get's span was released when the call returned and given to the next read; a
  late write by the node's transport then changed that read's bytes after
  verification (get thread) and before the copy into the pool (step thread).
- an arena exhausted by retired spans is a miss (the document is computed),
  counted, never a refusal.

The doubles are Mooncake's client under the real MooncakeChunkStore (its lanes,
codes and retirement are the code under test). Oracles: the bytes that were
put (the writer's pool rows) and a snapshot of the reader's pool taken before.
"""

from __future__ import annotations

import ctypes
import time

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.scheduler_adapter import (
    ChunkCacheSchedulerAdapter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store import mooncake
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (
    EntryFetch,
    EntryPut,
    FetchOutcome,
    StoreReport,
    StoreStep,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.spec import (
    parse_store_spec,
)
from vllm.v1.request import RequestStatus

from tests.unit.distributed.store.test_held_rows_limit import (
    DocumentHits,
    _scheduled_nothing,
)
from tests.unit.distributed.store.test_late_transport_writes import (
    _TRANSFER_FAIL,
    LATE,
    FailedThenLateClient,
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
from tests.unit.distributed.test_chunk_cache_scheduler_adapter import (
    finish,
    make_config,
    parent,
)

LIMIT_S = 30.0
# The defaults but the deadlines: no direct_reads.
IN_PROCESS = (
    "mooncake://127.0.0.1:1?read_timeout=0.05&timeout=0.05&arena=1MB&local_client=none"
)
NODE_CLIENT = (
    "mooncake://127.0.0.1:1?read_timeout=0.5&timeout=0.5&arena=1MB"
    "&local_client=127.0.0.1:2"
)


class ArenaClient(FailedThenLateClient):
    """FailedThenLateClient that reads into one buffer per key too (a read
    into the get arena), noting what the failed get was given (`spans`)."""

    def __init__(self):
        super().__init__()
        self.spans: list[tuple[int, int]] = []

    def batch_get_into(self, keys, ptrs, sizes):
        if self.block_first:
            self.spans = list(zip(ptrs, sizes))
        return self.batch_get_into_multi_buffers(
            keys, [[p] for p in ptrs], [[n] for n in sizes]
        )


class NodeClient(ArenaClient):
    """Mooncake's dummy client, in memory: the node's client makes the
    transfers, into this client's shared memory (`alloc_from_mem_pool`). The
    first get fails (TRANSFER_FAIL, at once), and the node's transport writes
    LATE into its buffers once `land` is set."""

    def __init__(self, shared_bytes: int = 8 << 20):
        super().__init__()
        self.memory = (ctypes.c_uint8 * shared_bytes)()
        self.used = 0
        self.go.set()

    def alloc_from_mem_pool(self, nbytes):
        ptr = ctypes.addressof(self.memory) + self.used
        self.used += nbytes + 64
        assert self.used <= len(self.memory)
        return ptr


def _landed_late(client, spans) -> None:
    client.land.set()
    assert client.landed.wait(10)
    for ptr, nbytes in spans:
        assert ctypes.string_at(ptr, nbytes) == bytes([LATE]) * nbytes, (
            "the late write did not land where the failed get was given"
        )


def test_a_get_failed_in_transfer_lends_no_pool_rows_and_the_pool_keeps_its_size(
    monkeypatch,
):
    """In process, default spec, a full pool (2 blocks): the document's read
    hangs, is given up on, then Mooncake fails it (TRANSFER_FAIL) and its
    transport writes late. The scheduler must see no rows lent: the document
    is computed at once and the parent served; past held_limit nothing is
    written off (the pool keeps its 2 blocks), and the late write reaches no
    pool row."""
    monkeypatch.setattr(mooncake, "_RETIRED", [], raising=False)
    adapter = ChunkCacheSchedulerAdapter(
        *make_config(
            num_kv_blocks=2,
            store=f"mooncake://127.0.0.1:1?lookup_timeout=600&held_limit={LIMIT_S:g}"
            "&local_client=none",
        )
    )
    now = [1000.0]
    adapter.manager.clock = lambda: now[0]
    adapter.manager.store_probe = DocumentHits()
    client = ArenaClient()
    store = mooncake.MooncakeChunkStore(parse_store_spec(IN_PROCESS), client)
    pool = small_pool(seed=3)
    before = {name: t.clone() for name, t in pool.items()}
    worker = transfers(IN_PROCESS, pool, store=store)
    wait_identity(worker)
    p = parent("p", [3, 5, 2])
    adapter.on_new_request(p)
    adapter.get_num_new_matched_tokens(p, 0)
    (sys_child,) = adapter.take_internal_requests()
    meta = adapter.build_connector_meta(_scheduled_nothing())
    (fetch,) = meta.store.fetches
    worker.on_step(meta.store)
    assert client.entered.wait(10)
    seen = StoreReport()
    deadline = time.monotonic() + 10
    while fetch.fetch_id not in seen.outcomes:  # given up on at its read deadline
        worker.on_step(StoreStep(epoch=0))
        report = worker.take_report()
        if report is not None:
            seen.aggregate(report)
            adapter.on_store_report(report)
        assert time.monotonic() < deadline, "the worker never gave the read up"
        time.sleep(0.01)
    assert seen.outcomes[fetch.fetch_id] == [FetchOutcome.TIMEOUT]
    client.go.set()  # Mooncake fails the get in transfer and returns
    assert store.wait_idle(10)
    _landed_late(client, client.spans)  # its transport writes late
    for _ in range(3):
        report = _reports(worker)
        seen.aggregate(report)
        adapter.on_store_report(report)
    assert store.stats.gets_retired == 1
    assert seen.rows_lent == {} and worker._rows_held == {}, (
        f"a failed get's pool rows were lent to the store: rows_lent {seen.rows_lent}"
    )
    for name, t in pool.items():
        assert torch.equal(t, before[name]), f"the late write reached the pool ({name})"

    # The document is computed at once in the pool (2 blocks: system + document).
    (doc_child,) = adapter.take_internal_requests()
    assert adapter.manager.stats().pool_blocks_held == 0
    for c in (sys_child, doc_child):
        finish(adapter, c, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert adapter.get_num_new_matched_tokens(p, 0) == (8, False)
    now[0] += 2 * LIMIT_S
    adapter.build_connector_meta(_scheduled_nothing())
    stats = adapter.manager.stats()
    assert adapter.take_failed_requests() == {}
    assert (stats.pool_blocks_total, stats.pool_blocks_held) == (2, 0), (
        f"the pool shrank: {stats}"
    )
    assert adapter.manager.pool.num_blocks == 2
    finish(adapter, p, RequestStatus.FINISHED_ABORTED)
    adapter.store.close()
    worker.close(timeout_s=0.2)


def test_a_failed_gets_span_is_not_reused_through_the_nodes_client(monkeypatch):
    """Through the node's client: f1's get fails (the node's transport keeps
    retrying), f2 reads the same entry once f1 is done with. f2's bytes are
    verified on the get thread; the late write of f1 lands then, before the
    step copies f2 into the pool. The pool must hold what was put."""
    monkeypatch.setattr(mooncake, "_RETIRED", [], raising=False)
    client = NodeClient()
    client.block_first = False
    store = mooncake.MooncakeChunkStore(parse_store_spec(NODE_CLIENT), client)
    src = small_pool(seed=1)
    writer = transfers(NODE_CLIENT, src, store=store)
    wait_identity(writer)
    a = entry([1] + list(range(10, 40)))
    writer.on_step(StoreStep(epoch=0, puts=[EntryPut(a, (0, 1))]))
    drain_puts(writer)
    assert writer.counters.get("store_puts") == 1 and client.values

    dst = small_pool(seed=2)
    reader = transfers(NODE_CLIENT, dst, store=store)
    wait_identity(reader)
    assert not reader.reads_into_pool()
    client.block_first = True  # the next get fails in transfer (at once)
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f1", a, (5, 6))]))
    assert step_until(reader, "f1") is FetchOutcome.ERROR
    failed_spans = client.spans
    assert failed_spans and not client.block_first

    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f2", a, (1, 2))]))
    f2 = reader._reads["f2"].future
    deadline = time.monotonic() + 10
    while not f2.done():  # read and verified on the get thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert f2.result() == [FetchOutcome.OK]
    _landed_late(client, failed_spans)  # before the step copies f2 into the pool
    assert step_until(reader, "f2") is FetchOutcome.OK
    got, want = rows_of(dst, (1, 2), 30), rows_of(src, (0, 1), 30)
    for name in got:
        late = (got[name].view(torch.uint8) == LATE).float().mean()
        assert torch.equal(got[name], want[name]), (
            f"{name}: a failed get's late write reached a later read's rows "
            f"({late:.0%} of bytes 0x7f)"
        )
    assert store.stats.gets_retired == 1
    untouched = rows_of(small_pool(seed=2), (5, 6), 30)
    for name, rows in rows_of(dst, (5, 6), 30).items():
        assert torch.equal(rows, untouched[name]), name


def test_an_arena_exhausted_by_retired_gets_is_a_counted_miss(monkeypatch):
    """Every get fails in transfer: each retires its span, until a read finds
    no room in the arena. That read is a miss (ERROR: the document is
    computed), counted, with no rows lent and the pool untouched; the store
    is not asked."""
    monkeypatch.setattr(mooncake, "_RETIRED", [], raising=False)

    class AlwaysFails(FailedThenLateClient):
        gets = 0

        def batch_get_into(self, keys, ptrs, sizes):
            self.gets += 1
            return [_TRANSFER_FAIL] * len(keys)

    client = AlwaysFails()
    store = mooncake.MooncakeChunkStore(parse_store_spec(IN_PROCESS), client)
    pool = small_pool(seed=2)
    before = {name: t.clone() for name, t in pool.items()}
    reader = transfers(IN_PROCESS, pool, store=store)
    wait_identity(reader)
    big = entry([1] + list(range(100, 164)))  # 64 rows: the largest entry
    outcomes = []
    for i in range(200):
        reader.on_step(
            StoreStep(epoch=0, fetches=[EntryFetch(f"f{i}", big, (0, 1, 2, 3))])
        )
        outcomes.append(step_until(reader, f"f{i}"))
        if reader.counters.get("store_reads_no_room"):
            break
    assert reader.counters.get("store_reads_no_room") == 1, "the arena never filled"
    assert set(outcomes) == {FetchOutcome.ERROR}
    assert store.stats.gets_retired == client.gets == len(outcomes) - 1 > 0
    merged = _reports(reader, 2)
    assert merged.rows_lent == {} and reader._rows_held == {}
    for name, t in pool.items():
        assert torch.equal(t, before[name]), name
    # Retired spans stay taken: the next read finds no room either.
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("again", big, (0, 1, 2, 3))]))
    assert step_until(reader, "again") is FetchOutcome.ERROR
    assert reader.counters.get("store_reads_no_room") == 2
    assert client.gets == len(outcomes) - 1
