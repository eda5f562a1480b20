# SPDX-License-Identifier: Apache-2.0
"""ChunkCacheManager with fake requests (prompts built by hand, no engine)."""

import dataclasses

import pytest
from vllm.v1.core.chunk_cache_manager import (
    CHILD_REQUEST_PREFIX,
    MAX_CHILD_ATTEMPTS,
    ChunkCacheManager,
    pool_blocks_for,
)
from vllm.v1.core.chunk_hash_index import compute_chunk_hash
from vllm.v1.core.chunk_structures import (
    AdmitReason,
    ChunkContextMode,
    ChunkedPrompt,
    ChunkNamespace,
    SegmentLoad,
    SegmentSpan,
    SegmentStatus,
)

from tests.chunk_manager_views import (
    StorePlan,
    child_finished,
    is_ready,
    load_plan,
    store_plan,
)

NS = ChunkNamespace(model="m", kv_dtype="bfloat16", tokenizer="t")
BOS = 1
# The deployment's sink token (the tokenizer's BOS), whatever a prompt starts with.
SINK = BOS
SYS = [BOS, 2, 3]
DOC_A = [10, 11, 12, 13, 14]
DOC_B = [20, 21]
DOC_C = [40, 41, 42, 43, 44, 45, 46, 47, 48]


def make_prompt(*segments: list[int]) -> ChunkedPrompt:
    spans, start = [], 0
    for seg in segments:
        spans.append(SegmentSpan(start, start + len(seg)))
        start += len(seg)
    return ChunkedPrompt([t for seg in segments for t in seg], tuple(spans))


def h(tokens, context, ns=NS):
    return compute_chunk_hash(tokens, context, ns.digest())


def child_id(n: int, key: bytes) -> str:
    return f"{CHILD_REQUEST_PREFIX}{n}-{key.hex()[:16]}"


def Manager(num_pool_blocks, block_size, context_mode=ChunkContextMode.SINK):
    return ChunkCacheManager(
        num_pool_blocks, block_size, context_mode, sink_token_id=SINK
    )


@dataclasses.dataclass(frozen=True)
class Admitted:
    """An admission and the children it started (handed out once, by the
    admission)."""

    reason: AdmitReason
    segments: tuple
    message: str
    new_children: tuple


def admitted(manager, rid) -> Admitted:
    adm = manager.admit(rid)
    return Admitted(adm.reason, adm.segments, adm.message, adm.children)


def admit(manager, rid, prompt, ns=NS) -> Admitted:
    """Arrival and admission at once (the scheduler asks right away)."""
    manager.add_request(rid, prompt, ns)
    return admitted(manager, rid)


def finish_all(manager, admission) -> list[str]:
    ready = []
    for child in admission.new_children:
        ready += child_finished(manager, child.request_id)
    return ready


def test_first_request_misses_everything_then_loads():
    m = Manager(num_pool_blocks=16, block_size=4)
    adm = admit(m, "r1", make_prompt(SYS, DOC_A, DOC_B, [30, 31]), NS)
    hs, ha, hb = h(SYS, []), h(DOC_A, [BOS]), h(DOC_B, [BOS])

    assert adm.reason == AdmitReason.ADMITTED and not is_ready(m, "r1")
    assert [s.status for s in adm.segments] == [SegmentStatus.MISSING] * 3
    assert [c.request_id for c in adm.new_children] == [
        child_id(0, hs),
        child_id(1, ha),
        child_id(2, hb),
    ]
    # System alone; chunks behind a private copy of the first token (sink).
    assert [c.token_ids for c in adm.new_children] == [
        SYS,
        [BOS] + DOC_A,
        [BOS] + DOC_B,
    ]
    assert [c.store_start for c in adm.new_children] == [0, 1, 1]
    assert store_plan(m, adm.new_children[1]) == StorePlan(
        request_id=child_id(1, ha),
        chunk_hash=ha,
        src_start=1,
        num_tokens=5,
        pool_block_ids=[1, 2],
    )

    assert child_finished(m, child_id(0, hs)) == []
    assert child_finished(m, child_id(1, ha)) == []
    assert not is_ready(m, "r1")
    # Not ready: its decision serves no rows.
    assert m.decide("r1", admit=False).segments == ()
    assert child_finished(m, child_id(2, hb)) == ["r1"]
    assert is_ready(m, "r1")

    plan = load_plan(m, "r1")
    assert plan.segments == (
        SegmentLoad(hs, 0, [0], 3, stored_start=0, dst_start=0),
        SegmentLoad(ha, 1, [1, 2], 5, stored_start=1, dst_start=3),
        SegmentLoad(hb, 2, [3], 2, stored_start=1, dst_start=8),
    )
    assert [s.position_delta for s in plan.segments] == [0, 2, 7]
    assert plan.num_rows_to_copy == 10  # the question (2 tokens) is computed

    # Only the parent's pins remain (writers released theirs).
    assert [m.pool.get(k).pin_count for k in (hs, ha, hb)] == [1, 1, 1]
    assert m.release("r1")
    assert m.pool.lru_order() == [hs, ha, hb]
    assert m.release("r1") is False
    stats = m.stats()
    assert (stats.hits, stats.misses, stats.tokens_reused) == (0, 3, 0)
    assert (stats.pool_blocks_used, stats.pool_blocks_total) == (4, 16)


def finish_children(manager, admission):
    for c in admission.new_children:
        child_finished(manager, c.request_id)


def test_reset_forgets_resident_segments_they_are_computed_again():
    """After a reset (new weights) the same prompt misses everything: the
    old rows are never served again, and the epoch is part of every key."""
    m = Manager(num_pool_blocks=16, block_size=4)
    prompt = make_prompt(SYS, DOC_A, [30])
    finish_children(m, admit(m, "r1", prompt))
    m.release("r1")
    assert m.reset() is True  # nothing was pinned
    assert m.stats().pool_blocks_used == 0 and m.pool.num_published == 0
    adm = admit(m, "r2", prompt)
    assert [s.status for s in adm.segments] == [SegmentStatus.MISSING] * 2
    assert len(adm.new_children) == 2
    assert adm.segments[0].chunk_hash != h(SYS, [])
    assert adm.segments[0].chunk_hash == h(
        SYS, [], dataclasses.replace(NS, weights_epoch=1)
    )
    stats = m.stats()
    assert (stats.hits, stats.misses, stats.evictions) == (0, 4, 0)


def test_reset_with_running_and_waiting_parents():
    """A reset while requests hold entries answers False (as vLLM's prefix
    cache does with blocks in use). A parent that was admitted before it and
    is asked again (waiting or preempted) is admitted afresh: its own rows
    are recomputed and the child that was computing with the old weights is
    not indexed; a running parent keeps its rows until it finishes."""
    m = Manager(num_pool_blocks=16, block_size=4)
    running = make_prompt(SYS, DOC_A, [30])
    finish_children(m, admit(m, "run", running))
    assert is_ready(m, "run")
    old = admit(m, "wait", make_prompt(SYS, DOC_B, [31]))
    assert [s.status for s in old.segments] == [
        SegmentStatus.RESIDENT,
        SegmentStatus.MISSING,
    ]
    assert m.reset() is False
    # "run" may still read its retired rows.
    assert load_plan(m, "run").num_rows_to_copy == 8
    # The old child finishes after the reset: its rows are not found again.
    child_finished(m, old.new_children[0].request_id)
    adm = admitted(m, "wait")
    assert adm.reason == AdmitReason.ADMITTED
    assert [s.status for s in adm.segments] == [SegmentStatus.MISSING] * 2
    assert [c.token_ids for c in adm.new_children] == [SYS, [SINK] + DOC_B]
    m.release("run")
    finish_children(m, adm)
    m.release("wait")
    stats = m.stats()
    assert (stats.pinned_entries, stats.live_requests) == (0, 0)
    # Only the two new entries are left: the retired ones went with their pins.
    assert stats.pool_blocks_used == 1 + 1


def test_reordered_chunks_after_another_system_prompt_hit():
    m = Manager(num_pool_blocks=16, block_size=4)
    finish_all(m, admit(m, "r1", make_prompt(SYS, DOC_A, DOC_B, [30]), NS))
    m.release("r1")

    sys2 = [BOS, 5]
    adm = admit(m, "r2", make_prompt(sys2, DOC_B, DOC_A, [31, 32]), NS)
    assert [s.status for s in adm.segments] == [
        SegmentStatus.MISSING,
        SegmentStatus.RESIDENT,
        SegmentStatus.RESIDENT,
    ]
    h2 = h(sys2, [])
    assert [c.request_id for c in adm.new_children] == [child_id(3, h2)]
    assert child_finished(m, child_id(3, h2)) == ["r2"]
    plan = load_plan(m, "r2")
    ha, hb = h(DOC_A, [BOS]), h(DOC_B, [BOS])
    assert plan.segments == (
        SegmentLoad(h2, 0, [4], 2, stored_start=0, dst_start=0),
        SegmentLoad(hb, 1, [3], 2, stored_start=1, dst_start=2),
        SegmentLoad(ha, 2, [1, 2], 5, stored_start=1, dst_start=4),
    )
    assert [s.position_delta for s in plan.segments] == [0, 1, 3]
    stats = m.stats()
    assert (stats.hits, stats.misses, stats.tokens_reused) == (2, 4, 7)
    assert stats.hit_rate == pytest.approx(2 / 6)


def test_all_resident_request_is_ready_at_admission():
    m = Manager(num_pool_blocks=16, block_size=4)
    prompt = make_prompt(SYS, DOC_A, [30])
    finish_all(m, admit(m, "r1", prompt, NS))
    m.release("r1")
    adm = admit(m, "r2", prompt, NS)
    assert is_ready(m, "r2") and adm.new_children == ()
    assert is_ready(m, "r2")


def test_concurrent_duplicate_misses_share_one_child():
    m = Manager(num_pool_blocks=16, block_size=4)
    a1 = admit(m, "r1", make_prompt(SYS, DOC_A, DOC_B, [30]), NS)
    a2 = admit(m, "r2", make_prompt(SYS, DOC_B, DOC_C, [31]), NS)
    hs, ha, hb, hc = h(SYS, []), h(DOC_A, [BOS]), h(DOC_B, [BOS]), h(DOC_C, [BOS])
    assert [c.chunk_hash for c in a1.new_children] == [hs, ha, hb]
    # r2 joins r1's children for SYS and DOC_B; only DOC_C is new.
    assert [s.status for s in a2.segments] == [
        SegmentStatus.IN_FLIGHT,
        SegmentStatus.IN_FLIGHT,
        SegmentStatus.MISSING,
    ]
    assert [c.request_id for c in a2.new_children] == [child_id(3, hc)]
    # Writer pin + one pin per parent.
    assert m.pool.get(hb).pin_count == 3

    assert child_finished(m, child_id(0, hs)) == []
    assert child_finished(m, child_id(2, hb)) == []
    assert child_finished(m, child_id(3, hc)) == ["r2"]
    assert child_finished(m, child_id(1, ha)) == ["r1"]
    assert load_plan(m, "r2").segments[1] == SegmentLoad(
        hb, 1, [3], 2, stored_start=1, dst_start=3
    )
    stats = m.stats()
    assert (stats.misses, stats.in_flight_joins, stats.hits) == (4, 2, 0)


def test_same_chunk_twice_in_one_request():
    m = Manager(num_pool_blocks=16, block_size=4)
    adm = admit(m, "r1", make_prompt(SYS, DOC_B, DOC_A, DOC_B, [30]), NS)
    hb = h(DOC_B, [BOS])
    assert [c.chunk_hash for c in adm.new_children].count(hb) == 1
    finish_all(m, adm)
    loads = [s for s in load_plan(m, "r1").segments if s.chunk_hash == hb]
    assert [(s.dst_start, s.position_delta) for s in loads] == [(3, 2), (10, 9)]
    assert m.pool.get(hb).pin_count == 1  # one pin per distinct key
    m.release("r1")
    assert m.pool.get(hb).pin_count == 0


def test_abort_while_waiting_releases_pins_and_child_still_caches():
    m = Manager(num_pool_blocks=16, block_size=4)
    adm = admit(m, "r1", make_prompt(SYS, DOC_A, [30]), NS)
    assert m.release("r1")  # abort before the children finish
    assert [m.pool.get(c.chunk_hash).pin_count for c in adm.new_children] == [1, 1]
    assert finish_all(m, adm) == []  # nobody waits any more
    hs, ha = h(SYS, []), h(DOC_A, [BOS])
    assert m.pool.lru_order() == [hs, ha]
    admit(m, "r2", make_prompt(SYS, DOC_A, [31]), NS)
    assert is_ready(m, "r2")


def test_failed_child_is_retried_once_then_its_waiters_are_refused():
    m = Manager(num_pool_blocks=16, block_size=4)
    a1 = admit(m, "r1", make_prompt(SYS, DOC_A, [30]))
    admit(m, "r2", make_prompt(SYS, DOC_A, DOC_B, [31]))
    hs, ha, hb = h(SYS, []), h(DOC_A, [BOS]), h(DOC_B, [BOS])
    blocks = m.pool.get(ha).block_ids

    # First failure: a retry with a new id, same entry and blocks, same waiters.
    (retry,) = m.finish_child(child_id(1, ha), stored=False).children
    assert retry is not None and retry.request_id == child_id(3, ha)
    assert retry.token_ids == [SINK] + DOC_A and retry.store_start == 1
    assert m.pool.get(ha).block_ids == blocks
    assert m.take_refusals() == []

    # Second failure: refused, never served otherwise; pins and entry gone.
    assert (
        m.finish_child(
            retry.request_id, stored=False, ended="FINISHED_ABORTED"
        ).children
        == ()
    )
    assert ha not in m.pool
    refusals = m.take_refusals()
    assert [(r.request_id, r.reason) for r in refusals] == [
        ("r1", AdmitReason.CHILD_FAILED),
        ("r2", AdmitReason.CHILD_FAILED),
    ]
    # The client is told which segment, how it ended and that a retry is safe.
    for r in refusals:
        assert (
            f"document 1 of this request ({len(DOC_A)} tokens, chunk key "
            f"{ha.hex()[:16]}) could not be computed (2 attempts, the last "
            "ended FINISHED_ABORTED)" in r.message
        )
        assert "retrying the request is safe" in r.message
    assert not is_ready(m, "r1")
    assert m.admit("r1").reason == AdmitReason.CHILD_FAILED
    # Remaining children still complete into entries nobody pins.
    assert child_finished(m, a1.new_children[0].request_id) == []
    assert child_finished(m, child_id(2, hb)) == []
    assert m.release("r1") and m.release("r2")
    assert m.pool.lru_order() == [hs, hb]
    stats = m.stats()
    assert (stats.failed_children, stats.refused_requests) == (2, 2)
    assert stats.child_computes == 4 and MAX_CHILD_ATTEMPTS == 2
    assert (stats.pinned_entries, stats.live_requests) == (0, 0)


def test_segments_that_can_never_fit_are_refused_with_the_numbers():
    m = Manager(num_pool_blocks=3, block_size=4)
    prompt = make_prompt(SYS, DOC_A, DOC_B, [30])  # needs 1 + 2 + 1 = 4 blocks
    assert pool_blocks_for(prompt, 4, ChunkContextMode.SINK) == 4
    adm = admit(m, "r1", prompt)
    assert adm.reason == AdmitReason.OVERSIZED and adm.segments == ()
    assert "need 4 chunk pool blocks" in adm.message and "--chunk-pool" in adm.message
    assert [r.request_id for r in m.take_refusals()] == ["r1"]
    assert m.pool.usage().num_entries == 0
    assert m.release("r1")
    assert m.stats().refused_requests == 1


def test_pool_pinned_full_defers_and_keeps_pins_of_others():
    m = Manager(num_pool_blocks=4, block_size=4)
    a1 = admit(m, "r1", make_prompt(SYS, DOC_A, [30]))  # 3 blocks, pinned
    finish_all(m, a1)
    hs, ha = h(SYS, []), h(DOC_A, [BOS])
    # r2 hits SYS (pin) but DOC_C needs 3 blocks: 1 free, nothing evictable.
    a2 = admit(m, "r2", make_prompt(SYS, DOC_C, [31]))
    assert a2.reason == AdmitReason.DEFERRED
    assert m.pool.get(hs).pin_count == 1  # r2's pin was given back
    assert m.pool.get(ha).pin_count == 1

    m.release("r1")
    # Now DOC_A (2 blocks) is evictable: r2 evicts exactly it (SYS is pinned
    # by r2 itself) and its key leaves the index.
    a2 = admitted(m, "r2")
    assert a2.reason == AdmitReason.ADMITTED
    assert ha not in m.pool and not m.pool.is_published(ha)
    assert store_plan(m, a2.new_children[0]).pool_block_ids == [3, 1, 2]
    stats = m.stats()
    assert (stats.evictions, stats.deferred_requests, stats.refused_requests) == (
        1,
        1,
        0,
    )


def test_nothing_is_pinned_before_admission():
    m = Manager(num_pool_blocks=16, block_size=4)
    finish_all(m, admit(m, "r1", make_prompt(SYS, DOC_A, [30])))
    m.release("r1")
    m.add_request("r2", make_prompt(SYS, DOC_A, [31]), NS)  # queued in vLLM
    assert m.stats().pinned_entries == 0
    assert m.pool.lru_order() == [h(SYS, []), h(DOC_A, [BOS])]
    m.admit("r2")
    assert is_ready(m, "r2")
    assert m.stats().pinned_entries == 2


def test_deferred_requests_are_admitted_in_arrival_order():
    """A big request among a stream of small ones is not starved."""
    m = Manager(num_pool_blocks=6, block_size=4)
    small = [make_prompt([BOS, 100 + i], [200 + i]) for i in range(8)]
    big = make_prompt(SYS, DOC_A, DOC_C, [30])  # 1 + 2 + 3 = 6 blocks: the whole pool
    # Two small requests are running (2 pinned blocks).
    finish_all(m, admit(m, "s0", small[0]))
    finish_all(m, admit(m, "s1", small[1]))
    m.add_request("big", big, NS)
    for i in range(2, 8):
        m.add_request(f"s{i}", small[i], NS)
    # The scheduler asks in queue order every step: big waits for room, and
    # the small ones behind it wait too although they would fit.
    for _ in range(3):
        assert m.admit("big").reason == AdmitReason.DEFERRED
        assert all(m.admit(f"s{i}").reason == AdmitReason.DEFERRED for i in range(2, 8))
    m.release("s0")
    m.release("s1")
    big_admission = m.admit("big")
    assert big_admission.reason == AdmitReason.ADMITTED
    assert m.admit("s2").reason == AdmitReason.DEFERRED  # the pool is big's now
    for child in big_admission.children:
        child_finished(m, child.request_id)
    m.release("big")
    assert m.admit("s2").reason == AdmitReason.ADMITTED
    assert m.stats().deferred_requests == 7


def test_sink_is_the_deployment_constant_not_the_first_token():
    m = Manager(num_pool_blocks=16, block_size=4)
    finish_all(m, admit(m, "r1", make_prompt([7, 8], DOC_A, [30])))
    adm = admit(m, "r2", make_prompt([9], DOC_A, [31]))  # another first token
    assert [s.status for s in adm.segments] == [
        SegmentStatus.MISSING,
        SegmentStatus.RESIDENT,
    ]
    assert adm.segments[1].chunk_hash == h(DOC_A, [SINK])
    with pytest.raises(ValueError, match="sink token"):
        ChunkCacheManager(4, 4, ChunkContextMode.SINK, sink_token_id=None)


@pytest.mark.parametrize(
    "mode, context, stored_start",
    [
        (ChunkContextMode.NONE, [], 0),
        (ChunkContextMode.SINK, [BOS], 1),
        (ChunkContextMode.SYSTEM, SYS, 3),
    ],
)
def test_context_modes(mode, context, stored_start):
    m = Manager(num_pool_blocks=16, block_size=4, context_mode=mode)
    adm = admit(m, "r1", make_prompt(SYS, DOC_A, [30]), NS)
    child = adm.new_children[1]
    assert child.chunk_hash == h(DOC_A, context)
    assert child.token_ids == context + DOC_A
    assert child.store_start == stored_start
    finish_all(m, adm)
    seg = load_plan(m, "r1").segments[1]
    assert (seg.stored_start, seg.position_delta) == (stored_start, 3 - stored_start)


def test_system_mode_key_depends_on_system_prompt_sink_mode_does_not():
    for mode, expected in (
        (ChunkContextMode.SYSTEM, SegmentStatus.MISSING),
        (ChunkContextMode.SINK, SegmentStatus.RESIDENT),
        (ChunkContextMode.NONE, SegmentStatus.RESIDENT),
    ):
        m = Manager(num_pool_blocks=16, block_size=4, context_mode=mode)
        finish_all(m, admit(m, "r1", make_prompt(SYS, DOC_A, [30]), NS))
        adm = admit(m, "r2", make_prompt([BOS, 9], DOC_A, [30]), NS)
        assert adm.segments[1].status == expected, mode


def test_none_mode_chunk_and_system_segment_share_identical_kv():
    # A segment computed alone at 0 is the same KV whether it is a system
    # prompt or a chunk in `none` mode, so the key is the same too.
    m = Manager(4, 4, context_mode=ChunkContextMode.NONE)
    finish_all(m, admit(m, "r1", make_prompt(DOC_B, [30]), NS))
    adm = admit(m, "r2", make_prompt(SYS, DOC_B, [31]), NS)
    assert adm.segments[1].status == SegmentStatus.RESIDENT


def test_cache_salt_isolates_tenants():
    m = Manager(num_pool_blocks=16, block_size=4)
    prompt = make_prompt(SYS, DOC_A, [30])
    finish_all(m, admit(m, "r1", prompt, NS))
    salted = dataclasses.replace(NS, cache_salt="tenant-b")
    adm = admit(m, "r2", prompt, salted)
    assert [s.status for s in adm.segments] == [SegmentStatus.MISSING] * 2


def test_hash_collision_is_refused_never_serves_other_tokens():
    m = Manager(num_pool_blocks=16, block_size=4)
    ha = h(DOC_A, [BOS])
    # Forced collision: DOC_A's key filed with other content.
    m.pool.allocate(ha, 2)
    m.pool.publish(ha, [99, 98], [BOS])
    adm = admit(m, "r1", make_prompt(SYS, DOC_A, [30]))
    assert adm.reason == AdmitReason.COLLISION
    stats = m.stats()
    assert (stats.hash_collisions, stats.refused_requests) == (1, 1)
    assert (stats.pinned_entries, stats.pool_blocks_used) == (0, 1)  # nothing taken


def test_api_misuse_is_reported():
    m = Manager(num_pool_blocks=16, block_size=4)
    admit(m, "r1", make_prompt(SYS, [30]))
    with pytest.raises(ValueError, match="already known"):
        m.add_request("r1", make_prompt(SYS, [30]), NS)
    assert m.decide("nope") is None  # not a chunk-cache parent
    with pytest.raises(KeyError, match="not a chunk-cache child"):
        child_finished(m, "nope")
    with pytest.raises(KeyError, match="not a chunk-cache child"):
        m.finish_child("nope", stored=True)
