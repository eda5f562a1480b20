"""Issue 50, finding 4: pool rows lent to a store call that never returns have a
bound. The scheduler half (a real adapter and manager) is driven by the reports of a
real worker store path (StoreTransfers) whose store double blocks its first read
(BlockingScatterStore: a call that does not return until the test says so). The age
limit is counted on the manager's injected clock and checked once per scheduler step
(`build_connector_meta`); nothing here asserts a duration."""

from __future__ import annotations

import time

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.scheduler_adapter import (
    ChunkCacheSchedulerAdapter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (
    FetchOutcome,
    StoreStep,
)
from vllm.v1.core.chunk_store_probe import StoreAnswer, StoreLookup
from vllm.v1.request import RequestStatus

from tests.unit.distributed.store.test_store_transfers import (
    BlockingScatterStore,
    rows_of,
    small_pool,
    transfers,
    wait_identity,
)
from tests.unit.distributed.test_chunk_cache_scheduler_adapter import (
    finish,
    make_config,
    parent,
)

LIMIT_S = 30.0


class DocumentHits:
    """The store holds the document (its tokens start at 13), not the system."""

    def lookup(self, segment_ids, context_ids, namespace):
        if segment_ids[0] == 13:
            return StoreLookup(StoreAnswer.HIT, content_hash=13)
        return StoreLookup(StoreAnswer.MISS)


def _scheduled_nothing():
    from types import SimpleNamespace

    return SimpleNamespace(
        scheduled_new_reqs=[],
        num_scheduled_tokens={},
        preempted_req_ids=None,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
    )


def _stuck_read(num_kv_blocks: int):
    """Parent [3, 5, 2]: the system is computed by a child, the document read from
    the store by a worker whose call blocks. Returns once the scheduler took the
    read's TIMEOUT (rows lent) from the worker's report."""
    adapter = ChunkCacheSchedulerAdapter(
        *make_config(
            num_kv_blocks=num_kv_blocks,
            store=f"mooncake://127.0.0.1:1?lookup_timeout=600&held_limit={LIMIT_S:g}"
            "&local_client=none",
        )
    )
    now = [1000.0]
    adapter.manager.clock = lambda: now[0]
    adapter.manager.store_probe = DocumentHits()
    store = BlockingScatterStore()
    pool = small_pool(seed=3)
    # NOTE: reads into the pool rows (direct_reads): only those lend rows.
    worker = transfers(
        "mooncake://127.0.0.1:1?read_timeout=0.05&timeout=0.05&arena=1MB"
        "&local_client=none&direct_reads=1",
        pool,
        store=store,
    )
    wait_identity(worker)
    p = parent("p", [3, 5, 2])
    adapter.on_new_request(p)
    adapter.get_num_new_matched_tokens(p, 0)
    (sys_child,) = adapter.take_internal_requests()
    meta = adapter.build_connector_meta(_scheduled_nothing())
    (fetch,) = meta.store.fetches
    worker.on_step(meta.store)
    assert store.entered.wait(10)
    deadline = time.monotonic() + 10
    while True:
        worker.on_step(StoreStep(epoch=0))
        report = worker.take_report()
        if report is not None and fetch.fetch_id in report.outcomes:
            break
        assert time.monotonic() < deadline, "the worker never gave the read up"
        time.sleep(0.01)
    assert report.outcomes[fetch.fetch_id] == [FetchOutcome.TIMEOUT]
    assert report.rows_lent == {fetch.fetch_id: 1}
    adapter.on_store_report(report)
    return adapter, now, store, worker, pool, p, sys_child, fetch


def _late_write_returns(store, worker, adapter, fetch_id):
    """Let the stuck call write and return; hand its report to the scheduler."""
    store.go.set()
    deadline = time.monotonic() + 10
    while True:
        worker.on_step(StoreStep(epoch=0))
        report = worker.take_report()
        if report is not None:
            adapter.on_store_report(report)
        if report is not None and report.rows_returned:
            assert report.rows_returned == {fetch_id: 1}
            return
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_fetch_waiting_for_rows_that_never_return_is_refused_at_the_limit():
    """Full pool (2 blocks): the failed read waits for its rows. Those blocks are
    counted as held while it waits; at the limit they are written off (the pool
    shrinks, a counter and a log line say so), and the parent, with no other room
    for its document, is refused with a message saying why. The call's late return
    gives nothing back."""
    adapter, now, store, worker, pool, p, sys_child, fetch = _stuck_read(
        num_kv_blocks=2
    )
    assert adapter.manager.pool.num_blocks == 2
    assert adapter.take_internal_requests() == []  # waits: no room for other blocks
    assert adapter.manager.stats().pool_blocks_held == 1, (
        "the waiting fetch's blocks are held"
    )
    now[0] += LIMIT_S - 1
    adapter.build_connector_meta(_scheduled_nothing())
    assert (
        adapter.take_failed_requests() == {}
        and adapter.manager.stats().pool_blocks_held == 1
    )

    now[0] += 1
    adapter.build_connector_meta(_scheduled_nothing())
    failed = adapter.take_failed_requests()
    assert list(failed) == ["p"] and "written off" in failed["p"], failed
    assert "document 1" in failed["p"] and "retrying the request is safe" in failed["p"]
    stats = adapter.manager.stats()
    assert (stats.pool_blocks_total, stats.pool_blocks_held) == (1, 0)
    assert adapter.store.counters.take().get("store_reads_written_off") == 1
    assert adapter.get_num_new_matched_tokens(p, 0) == (None, False)  # never served

    _late_write_returns(store, worker, adapter, fetch.fetch_id)
    late = rows_of(pool, fetch.pool_block_ids, 5)
    assert all((v.view(torch.uint8) == 0x7F).all() for v in late.values())
    assert set(fetch.pool_block_ids).isdisjoint(adapter.manager.pool._free_blocks)
    assert adapter.manager.pool.num_blocks == 1
    finish(adapter, sys_child, RequestStatus.FINISHED_LENGTH_CAPPED)
    finish(adapter, p, RequestStatus.FINISHED_ABORTED)
    for _ in range(2):  # the system entry's put is shipped, then copied
        adapter.build_connector_meta(_scheduled_nothing())
    assert adapter.manager.stats().pinned_entries == 0
    adapter.store.close()
    worker.close(timeout_s=1.0)


def test_rows_held_past_the_limit_after_the_document_was_computed_elsewhere_leave():
    """Room in the pool (3 blocks): the document is computed in other blocks at
    once and the parent served; the lent blocks are held, then written off at the
    limit, and never handed out again, not even after the call's late return."""
    adapter, now, store, worker, pool, p, sys_child, fetch = _stuck_read(
        num_kv_blocks=3
    )
    (doc_child,) = adapter.take_internal_requests()
    assert adapter.manager.pool.held_by(fetch.fetch_id) == fetch.pool_block_ids
    for c in (sys_child, doc_child):
        finish(adapter, c, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert adapter.get_num_new_matched_tokens(p, 0) == (8, False)
    now[0] += LIMIT_S
    adapter.build_connector_meta(_scheduled_nothing())
    stats = adapter.manager.stats()
    assert (stats.pool_blocks_total, stats.pool_blocks_held) == (2, 0)
    assert adapter.take_failed_requests() == {}
    _late_write_returns(store, worker, adapter, fetch.fetch_id)
    assert set(fetch.pool_block_ids).isdisjoint(adapter.manager.pool._free_blocks)
    assert adapter.manager.pool.num_blocks == 2
    adapter.store.close()
    worker.close(timeout_s=1.0)


def test_rows_held_past_the_limit_are_written_off_on_a_step_without_a_worker_report():
    """The write-off is the scheduler's, once per step: it never waits for a worker
    report. Workers send one only when something of theirs changed, and a call that
    never returns changes nothing; so an engine whose every request waited for the
    held rows (a full pool) sent none, and the rows were never written off
    (test_chunk_store_late_write.py hung there once Mooncake's failed gets were
    retired)."""
    adapter, now, store, worker, pool, p, sys_child, fetch = _stuck_read(
        num_kv_blocks=2
    )
    assert adapter.take_internal_requests() == []  # waits: no room for other blocks
    now[0] += LIMIT_S - 1
    adapter.build_connector_meta(_scheduled_nothing())
    assert (
        adapter.take_failed_requests() == {}
        and adapter.manager.stats().pool_blocks_held == 1
    )

    now[0] += 1
    worker.on_step(StoreStep(epoch=0))
    assert worker.take_report() is None, "the stuck call reports nothing"
    adapter.build_connector_meta(_scheduled_nothing())  # a step, no report
    failed = adapter.take_failed_requests()
    assert list(failed) == ["p"] and "written off" in failed["p"], (
        "held rows past held_limit not written off on a step without a report: "
        f"refused {failed}, pool {adapter.manager.stats()}"
    )
    stats = adapter.manager.stats()
    assert (stats.pool_blocks_total, stats.pool_blocks_held) == (1, 0)
    assert adapter.store.counters.take().get("store_reads_written_off") == 1

    _late_write_returns(store, worker, adapter, fetch.fetch_id)
    assert adapter.manager.pool.num_blocks == 1
    finish(adapter, sys_child, RequestStatus.FINISHED_LENGTH_CAPPED)
    finish(adapter, p, RequestStatus.FINISHED_ABORTED)
    adapter.store.close()
    worker.close(timeout_s=1.0)
