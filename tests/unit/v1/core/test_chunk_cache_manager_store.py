# SPDX-License-Identifier: Apache-2.0
"""The manager's store policy (issue 31) with a scripted probe (no store, no
engine): a pending query waits without pins, a hit becomes a fetch pinned like
a child, a failed fetch becomes a child, a finished one serves its parents; a
failed fetch whose rows a store call still holds computes into new blocks and
holds the old ones until they are returned."""

import pytest
from vllm.v1.core.chunk_cache_manager import ChunkCacheManager
from vllm.v1.core.chunk_step_decision import Outcome
from vllm.v1.core.chunk_store_probe import FETCH_ID_PREFIX, StoreAnswer, StoreLookup
from vllm.v1.core.chunk_structures import (
    AdmitReason,
    ChunkContextMode,
    ChunkedPrompt,
    ChunkNamespace,
    SegmentSpan,
)

from tests.chunk_manager_views import (
    child_finished,
    is_ready,
    load_plan,
    report,
    store_plan,
)

NS = ChunkNamespace(model="m", kv_dtype="float32", tokenizer="t")
SYS = [1, 2, 3]
DOC_A = [10, 11, 12, 13, 14]
DOC_B = [20, 21]
Q = [30, 31]


def prompt(*segments: list[int]) -> ChunkedPrompt:
    spans, start = [], 0
    for seg in segments:
        spans.append(SegmentSpan(start, start + len(seg)))
        start += len(seg)
    return ChunkedPrompt([t for seg in segments for t in seg], tuple(spans))


class ScriptedProbe:
    """Answers by segment tokens; records what was asked."""

    def __init__(self):
        self.answers: dict[tuple[int, ...], StoreAnswer] = {}
        self.asked: list[tuple[tuple[int, ...], int]] = []

    def lookup(self, segment_ids, context_ids, namespace):
        self.asked.append((tuple(segment_ids), namespace.weights_epoch))
        answer = self.answers.get(tuple(segment_ids), StoreAnswer.MISS)
        return StoreLookup(answer, content_hash=sum(segment_ids))


def manager(probe) -> ChunkCacheManager:
    return ChunkCacheManager(64, 4, ChunkContextMode.SINK, sink_token_id=1, store=probe)


def test_pending_query_waits_a_step_holding_nothing():
    probe = ScriptedProbe()
    probe.answers[tuple(DOC_A)] = StoreAnswer.PENDING
    m = manager(probe)
    m.add_request("p", prompt(SYS, DOC_A, Q), NS)
    adm = m.admit("p")
    assert adm.reason == AdmitReason.DEFERRED
    assert adm.children == () and adm.fetches == ()
    assert m.pool.usage().blocks_used == 0
    assert m.stats().deferred_requests == 0  # waiting for the network is not "deferred"
    probe.answers[tuple(DOC_A)] = StoreAnswer.HIT
    assert m.admit("p").reason == AdmitReason.ADMITTED


def test_hit_is_fetched_not_computed_and_serves_every_waiter():
    probe = ScriptedProbe()
    probe.answers[tuple(DOC_A)] = StoreAnswer.HIT
    m = manager(probe)
    m.add_request("p", prompt(SYS, DOC_A, Q), NS)
    m.add_request("q", prompt(SYS, DOC_A, DOC_B, Q), NS)
    adm = m.admit("p")
    assert adm.reason == AdmitReason.ADMITTED
    children, fetches = adm.children, adm.fetches
    assert [c.token_ids for c in children] == [SYS]  # the system misses: computed
    assert len(fetches) == 1 and fetches[0].request_id.startswith(FETCH_ID_PREFIX)
    fetch = fetches[0]
    assert fetch.token_ids == [1] + DOC_A and fetch.store_start == 1
    assert fetch.content_hash == sum(DOC_A) and fetch.epoch == 0
    assert m.stats().child_computes == 1
    # The fetch's entry is allocated and pinned like a child's (writer + parent).
    plan = store_plan(m, fetch)
    assert plan.num_tokens == len(DOC_A)
    assert m.pool.get(fetch.chunk_hash).pin_count == 2
    # A second parent joins the fetch in flight (no second lookup of DOC_A).
    asked = len(probe.asked)
    adm = m.admit("q")
    assert adm.reason == AdmitReason.ADMITTED and adm.fetches == ()
    assert all(seg != tuple(DOC_A) for seg, _ in probe.asked[asked:])
    assert m.stats().in_flight_joins >= 1
    child_finished(m, children[0].request_id)
    assert not is_ready(m, "p")
    ready = list(report(m, done=[fetch.request_id]).ready)
    assert ready == ["p"] and is_ready(m, "p")
    # Resident now: a later parent hits the pool without asking the store.
    m.add_request("r", prompt(SYS, DOC_A, Q), NS)
    asked = len(probe.asked)
    m.admit("r")
    assert is_ready(m, "r")
    assert len(probe.asked) == asked


def test_failed_fetch_becomes_a_child_with_the_same_entry():
    probe = ScriptedProbe()
    probe.answers[tuple(DOC_A)] = StoreAnswer.HIT
    m = manager(probe)
    m.add_request("p", prompt(SYS, DOC_A, Q), NS)
    adm = m.admit("p")
    sys_child, fetch = adm.children[0], adm.fetches[0]
    blocks = list(store_plan(m, fetch).pool_block_ids)
    (child,) = report(m, failed=[fetch.request_id]).children
    assert child.token_ids == [1] + DOC_A and child.chunk_hash == fetch.chunk_hash
    assert list(store_plan(m, child).pool_block_ids) == blocks
    assert m.stats().child_computes == 2
    child_finished(m, sys_child.request_id)
    assert child_finished(m, child.request_id) == ["p"]
    m.release("p")
    assert m.stats().pinned_entries == 0


def test_lookups_carry_the_epoch_and_a_reset_forgets_fetched_entries():
    probe = ScriptedProbe()
    probe.answers[tuple(DOC_A)] = StoreAnswer.HIT
    m = manager(probe)
    m.add_request("p", prompt(SYS, DOC_A, Q), NS)
    fetch = m.admit("p").fetches[0]
    m.reset()
    # Finished after the reset: never filed under a key (computed with weights
    # that may be gone).
    report(m, done=[fetch.request_id])
    m.release("p")
    m.add_request("q", prompt(SYS, DOC_A, Q), NS)
    (fetch,) = m.admit("q").fetches
    assert (tuple(DOC_A), 1) in probe.asked
    assert fetch.epoch == 1


def test_without_a_probe_nothing_is_asked():
    m = ChunkCacheManager(64, 4, ChunkContextMode.SINK, sink_token_id=1)
    m.add_request("p", prompt(SYS, DOC_A, Q), NS)
    adm = m.admit("p")
    assert adm.reason == AdmitReason.ADMITTED
    assert len(adm.children) == 2 and adm.fetches == ()


def small_manager(probe, num_blocks: int) -> ChunkCacheManager:
    return ChunkCacheManager(
        num_blocks, 4, ChunkContextMode.SINK, sink_token_id=1, store=probe
    )


def test_failed_fetch_with_lent_rows_computes_into_new_blocks_and_holds_the_old():
    """Issue 39, finding 9: a store call may still write into a timed-out
    read's rows, so its child never computes there; the rows are held until
    every rank returned them."""
    probe = ScriptedProbe()
    m = small_manager(probe, num_blocks=5)
    # A resident DOC_B, least recently used after SYS: SYS [0], DOC_B [1].
    m.add_request("o", prompt(SYS, DOC_B, Q), NS)
    for c in m.admit("o").children:
        child_finished(m, c.request_id)
    m.release("o")
    probe.answers[tuple(DOC_A)] = StoreAnswer.HIT
    m.add_request("p", prompt(SYS, DOC_A, Q), NS)
    adm = m.admit("p")
    assert adm.reason == AdmitReason.ADMITTED
    fetch = adm.fetches[0]
    assert store_plan(m, fetch).pool_block_ids == [2, 3]
    (child,) = report(m, lent=[fetch.request_id]).children
    assert child.token_ids == [1] + DOC_A and child.chunk_hash == fetch.chunk_hash
    # New blocks: the free one, then DOC_B's (evicted, gone from the index).
    assert store_plan(m, child).pool_block_ids == [4, 1]
    assert m.pool.held_by(fetch.request_id) == (2, 3)
    assert m.pool.lru_order() == [] and m.pool.num_published == 1  # only SYS is left
    stats = m.stats()
    assert (stats.evictions, stats.pool_blocks_held, stats.pool_blocks_used) == (
        1,
        2,
        5,
    )
    assert m.pool.get(fetch.chunk_hash).pin_count == 2  # writer + parent, as before
    assert child_finished(m, child.request_id) == ["p"]
    assert [s.pool_block_ids for s in load_plan(m, "p").segments] == [[0], [4, 1]]
    # Still held after the child finished: the store's call has not returned.
    assert m.pool.held_by(fetch.request_id) == (2, 3)
    assert report(m, rows_returned=[fetch.request_id]).children == ()
    assert m.stats().pool_blocks_held == 0 and list(m.pool._free_blocks) == [2, 3]
    with pytest.raises(KeyError):
        report(m, rows_returned=[fetch.request_id])  # returned once
    m.release("p")
    assert m.stats().pinned_entries == 0


def test_failed_fetch_with_lent_rows_and_no_room_waits_for_them_then_computes_there():
    """No room for new blocks: the fetch stays in flight (entry, blocks, pins,
    waiters kept; nothing computed) until its rows are back, then its child
    computes in them. Nobody is refused; a later request joins it."""
    probe = ScriptedProbe()
    probe.answers[tuple(DOC_A)] = StoreAnswer.HIT
    m = small_manager(probe, num_blocks=3)
    m.add_request("p", prompt(SYS, DOC_A, Q), NS)
    m.add_request("q", prompt(SYS, DOC_A, Q), NS)
    adm = m.admit("p")
    assert adm.reason == AdmitReason.ADMITTED
    assert m.admit("q").reason == AdmitReason.ADMITTED  # joins both in flight
    sys_child, fetch = adm.children[0], adm.fetches[0]
    assert store_plan(m, fetch).pool_block_ids == [1, 2]
    # SYS [0] is pinned, DOC_A's [1, 2] are lent: no room for new blocks.
    assert report(m, lent=[fetch.request_id]).children == ()
    assert m.take_refusals() == []
    assert m.pool.held_by(fetch.request_id) == ()
    assert m.pool.get(fetch.chunk_hash).block_ids == [1, 2]
    assert m.pool.get(fetch.chunk_hash).pin_count == 3  # writer, p, q
    assert child_finished(m, sys_child.request_id) == []  # p, q still wait
    # A third request joins the fetch still in flight (nothing new started).
    m.add_request("r", prompt(SYS, DOC_A, Q), NS)
    adm = m.admit("r")
    assert adm.reason == AdmitReason.ADMITTED
    assert adm.fetches == () and adm.children == ()
    (child,) = report(m, rows_returned=[fetch.request_id]).children
    assert child.token_ids == [1] + DOC_A
    assert store_plan(m, child).pool_block_ids == [1, 2]
    assert sorted(child_finished(m, child.request_id)) == ["p", "q", "r"]
    assert m.stats().pool_blocks_held == 0 and m.stats().refused_requests == 0
    for rid in "pqr":
        m.release(rid)
    assert m.stats().pinned_entries == 0


def test_without_a_held_rows_limit_lent_rows_are_never_written_off():
    """held_limit_s None: rows lent to a store call are held until returned,
    however long, and a fetch waiting for them keeps waiting."""
    probe = ScriptedProbe()
    probe.answers[tuple(DOC_A)] = StoreAnswer.HIT
    m = small_manager(probe, num_blocks=3)
    assert m.held_limit_s is None
    now = [0.0]
    m.clock = lambda: now[0]
    m.add_request("p", prompt(SYS, DOC_A, Q), NS)
    fetch = m.admit("p").fetches[0]
    assert report(m, lent=[fetch.request_id]).children == ()  # no room: waits
    now[0] = 1e9
    assert m.write_off_held() == Outcome()
    assert m.pool.num_blocks == 3 and m.stats().pool_blocks_held == 2
    (child,) = report(m, rows_returned=[fetch.request_id]).children
    assert store_plan(m, child).pool_block_ids == [1, 2]


def test_failed_fetch_without_lent_rows_keeps_its_blocks():
    probe = ScriptedProbe()
    probe.answers[tuple(DOC_A)] = StoreAnswer.HIT
    m = small_manager(probe, num_blocks=3)
    m.add_request("p", prompt(SYS, DOC_A, Q), NS)
    fetch = m.admit("p").fetches[0]
    # A full pool is no obstacle: every rank's call returned, the rows are free.
    # NOTE: the outcome also hands out SYS's child, still undrained here.
    child = report(m, failed=[fetch.request_id]).children[-1]
    assert child.chunk_hash == fetch.chunk_hash
    assert store_plan(m, child).pool_block_ids == [1, 2]
    assert m.stats().pool_blocks_held == 0 and m.take_refusals() == []
