# SPDX-License-Identifier: Apache-2.0
"""ChunkCacheManager with fake requests (prompts built by hand, no engine)."""

import dataclasses

import pytest

from vllm.v1.core.chunk_cache_manager import CHILD_REQUEST_PREFIX, ChunkCacheManager
from vllm.v1.core.chunk_hash_index import ChunkNamespace, compute_chunk_hash
from vllm.v1.core.chunk_structures import (
    ChunkContextMode,
    ChunkedPrompt,
    ChunkStorePlan,
    SegmentLoad,
    SegmentSpan,
    SegmentStatus,
)

NS = ChunkNamespace(model="m", kv_dtype="bfloat16", tokenizer="t")
BOS = 1
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


def finish_all(manager, admission) -> list[str]:
    ready = []
    for child in admission.new_children:
        ready += manager.child_finished(child.request_id)
    return ready


def test_first_request_misses_everything_then_loads():
    m = ChunkCacheManager(num_pool_blocks=16, block_size=4)
    adm = m.admit("r1", make_prompt(SYS, DOC_A, DOC_B, [30, 31]), NS)
    hs, ha, hb = h(SYS, []), h(DOC_A, [BOS]), h(DOC_B, [BOS])

    assert not adm.fallback and not adm.ready
    assert [s.status for s in adm.segments] == [SegmentStatus.MISSING] * 3
    assert [c.request_id for c in adm.new_children] == [
        child_id(0, hs), child_id(1, ha), child_id(2, hb)
    ]
    # System alone; chunks behind a private copy of the first token (sink).
    assert [c.token_ids for c in adm.new_children] == [SYS, [BOS] + DOC_A, [BOS] + DOC_B]
    assert [c.store_start for c in adm.new_children] == [0, 1, 1]
    assert m.is_child(child_id(1, ha)) and not m.is_child("r1")
    assert m.store_plan(child_id(1, ha)) == ChunkStorePlan(
        request_id=child_id(1, ha), chunk_hash=ha, src_start=1, num_tokens=5,
        pool_block_ids=[1, 2],
    )

    assert m.child_finished(child_id(0, hs)) == []
    assert m.child_finished(child_id(1, ha)) == []
    assert not m.is_ready("r1")
    with pytest.raises(ValueError, match="still waits for 1 segment"):
        m.load_plan("r1")
    assert m.child_finished(child_id(2, hb)) == ["r1"]
    assert m.is_ready("r1")

    plan = m.load_plan("r1")
    assert plan.segments == (
        SegmentLoad(hs, 0, [0], 3, stored_start=0, dst_start=0),
        SegmentLoad(ha, 1, [1, 2], 5, stored_start=1, dst_start=3),
        SegmentLoad(hb, 2, [3], 2, stored_start=1, dst_start=8),
    )
    assert [s.position_delta for s in plan.segments] == [0, 2, 7]
    assert plan.num_cached_tokens == 10  # the question (2 tokens) is computed

    # Only the parent's pins remain (writers released theirs).
    assert m.pinned_by("r1") == [hs, ha, hb]
    assert [m.pool.get(k).pin_count for k in (hs, ha, hb)] == [1, 1, 1]
    assert m.release("r1")
    assert m.pool.lru_order() == [hs, ha, hb]
    assert m.release("r1") is False
    stats = m.stats()
    assert (stats.hits, stats.misses, stats.tokens_reused) == (0, 3, 0)
    assert (stats.pool_blocks_used, stats.pool_blocks_total) == (4, 16)


def test_reordered_chunks_after_another_system_prompt_hit():
    m = ChunkCacheManager(num_pool_blocks=16, block_size=4)
    finish_all(m, m.admit("r1", make_prompt(SYS, DOC_A, DOC_B, [30]), NS))
    m.release("r1")

    sys2 = [BOS, 5]
    adm = m.admit("r2", make_prompt(sys2, DOC_B, DOC_A, [31, 32]), NS)
    assert [s.status for s in adm.segments] == [
        SegmentStatus.MISSING, SegmentStatus.RESIDENT, SegmentStatus.RESIDENT
    ]
    h2 = h(sys2, [])
    assert [c.request_id for c in adm.new_children] == [child_id(3, h2)]
    assert m.child_finished(child_id(3, h2)) == ["r2"]
    plan = m.load_plan("r2")
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
    m = ChunkCacheManager(num_pool_blocks=16, block_size=4)
    prompt = make_prompt(SYS, DOC_A, [30])
    finish_all(m, m.admit("r1", prompt, NS))
    m.release("r1")
    adm = m.admit("r2", prompt, NS)
    assert adm.ready and adm.new_children == ()
    assert m.is_ready("r2")


def test_concurrent_duplicate_misses_share_one_child():
    m = ChunkCacheManager(num_pool_blocks=16, block_size=4)
    a1 = m.admit("r1", make_prompt(SYS, DOC_A, DOC_B, [30]), NS)
    a2 = m.admit("r2", make_prompt(SYS, DOC_B, DOC_C, [31]), NS)
    hs, ha, hb, hc = h(SYS, []), h(DOC_A, [BOS]), h(DOC_B, [BOS]), h(DOC_C, [BOS])
    assert [c.chunk_hash for c in a1.new_children] == [hs, ha, hb]
    # r2 joins r1's children for SYS and DOC_B; only DOC_C is new.
    assert [s.status for s in a2.segments] == [
        SegmentStatus.IN_FLIGHT, SegmentStatus.IN_FLIGHT, SegmentStatus.MISSING
    ]
    assert [c.request_id for c in a2.new_children] == [child_id(3, hc)]
    # Writer pin + one pin per parent.
    assert m.pool.get(hb).pin_count == 3

    assert m.child_finished(child_id(0, hs)) == []
    assert m.child_finished(child_id(2, hb)) == []
    assert m.child_finished(child_id(3, hc)) == ["r2"]
    assert m.child_finished(child_id(1, ha)) == ["r1"]
    assert m.load_plan("r2").segments[1] == SegmentLoad(
        hb, 1, [3], 2, stored_start=1, dst_start=3
    )
    stats = m.stats()
    assert (stats.misses, stats.in_flight_joins, stats.hits) == (4, 2, 0)


def test_same_chunk_twice_in_one_request():
    m = ChunkCacheManager(num_pool_blocks=16, block_size=4)
    adm = m.admit("r1", make_prompt(SYS, DOC_B, DOC_A, DOC_B, [30]), NS)
    hb = h(DOC_B, [BOS])
    assert [c.chunk_hash for c in adm.new_children].count(hb) == 1
    finish_all(m, adm)
    loads = [s for s in m.load_plan("r1").segments if s.chunk_hash == hb]
    assert [(s.dst_start, s.position_delta) for s in loads] == [(3, 2), (10, 9)]
    assert m.pool.get(hb).pin_count == 1  # one pin per distinct key
    m.release("r1")
    assert m.pool.get(hb).pin_count == 0


def test_abort_while_waiting_releases_pins_and_child_still_caches():
    m = ChunkCacheManager(num_pool_blocks=16, block_size=4)
    adm = m.admit("r1", make_prompt(SYS, DOC_A, [30]), NS)
    assert m.release("r1")  # abort before the children finish
    assert [m.pool.get(c.chunk_hash).pin_count for c in adm.new_children] == [1, 1]
    assert finish_all(m, adm) == []  # nobody waits any more
    hs, ha = h(SYS, []), h(DOC_A, [BOS])
    assert m.pool.lru_order() == [hs, ha]
    assert m.admit("r2", make_prompt(SYS, DOC_A, [31]), NS).ready


def test_failed_child_makes_its_waiters_fall_back():
    m = ChunkCacheManager(num_pool_blocks=16, block_size=4)
    a1 = m.admit("r1", make_prompt(SYS, DOC_A, [30]), NS)
    m.admit("r2", make_prompt(SYS, DOC_A, DOC_B, [31]), NS)
    hs, ha, hb = h(SYS, []), h(DOC_A, [BOS]), h(DOC_B, [BOS])
    assert m.child_failed(child_id(1, ha)) == ["r1", "r2"]
    assert ha not in m.pool
    with pytest.raises(KeyError):
        m.is_ready("r1")
    # Remaining children still complete into unpinned resident entries.
    assert m.child_finished(a1.new_children[0].request_id) == []
    assert m.child_finished(child_id(2, hb)) == []
    assert m.pool.lru_order() == [hs, hb]
    stats = m.stats()
    assert (stats.failed_children, stats.fallbacks) == (1, 2)


def test_pool_too_small_falls_back_without_error():
    m = ChunkCacheManager(num_pool_blocks=3, block_size=4)
    adm = m.admit("r1", make_prompt(SYS, DOC_A, DOC_B, [30]), NS)  # needs 4
    assert adm.fallback and adm.segments == () and adm.new_children == ()
    assert not adm.ready
    assert m.pool.usage().num_entries == 0
    assert m.release("r1") is False  # nothing held
    assert m.stats().fallbacks == 1


def test_fallback_drops_pins_taken_before_and_never_evicts_pinned():
    m = ChunkCacheManager(num_pool_blocks=4, block_size=4)
    a1 = m.admit("r1", make_prompt(SYS, DOC_A, [30]), NS)  # 3 blocks, pinned
    finish_all(m, a1)
    hs, ha = h(SYS, []), h(DOC_A, [BOS])
    # r2 hits SYS (pin) but DOC_C needs 3 blocks: 1 free, nothing evictable.
    a2 = m.admit("r2", make_prompt(SYS, DOC_C, [31]), NS)
    assert a2.fallback
    assert m.pool.get(hs).pin_count == 1  # r2's pin was given back
    assert m.pool.get(ha).pin_count == 1

    m.release("r1")
    # Now DOC_A (2 blocks) is evictable: r3 evicts exactly it (LRU after SYS
    # is pinned by r3 itself) and its key leaves the index.
    a3 = m.admit("r3", make_prompt(SYS, DOC_C, [31]), NS)
    assert not a3.fallback
    assert ha not in m.pool and ha not in m.index
    assert m.store_plan(a3.new_children[0].request_id).pool_block_ids == [3, 1, 2]
    assert m.stats().evictions == 1
    a4 = m.admit("r4", make_prompt([BOS, 7], DOC_A, [32]), NS)
    assert a4.fallback  # DOC_A must be recomputed, but no room while pinned


@pytest.mark.parametrize(
    "mode, context, stored_start",
    [
        (ChunkContextMode.NONE, [], 0),
        (ChunkContextMode.SINK, [BOS], 1),
        (ChunkContextMode.SYSTEM, SYS, 3),
    ],
)
def test_context_modes(mode, context, stored_start):
    m = ChunkCacheManager(num_pool_blocks=16, block_size=4, context_mode=mode)
    adm = m.admit("r1", make_prompt(SYS, DOC_A, [30]), NS)
    child = adm.new_children[1]
    assert child.chunk_hash == h(DOC_A, context)
    assert child.token_ids == context + DOC_A
    assert child.store_start == stored_start
    finish_all(m, adm)
    seg = m.load_plan("r1").segments[1]
    assert (seg.stored_start, seg.position_delta) == (stored_start, 3 - stored_start)


def test_system_mode_key_depends_on_system_prompt_sink_mode_does_not():
    for mode, expected in (
        (ChunkContextMode.SYSTEM, SegmentStatus.MISSING),
        (ChunkContextMode.SINK, SegmentStatus.RESIDENT),
        (ChunkContextMode.NONE, SegmentStatus.RESIDENT),
    ):
        m = ChunkCacheManager(num_pool_blocks=16, block_size=4, context_mode=mode)
        finish_all(m, m.admit("r1", make_prompt(SYS, DOC_A, [30]), NS))
        adm = m.admit("r2", make_prompt([BOS, 9], DOC_A, [30]), NS)
        assert adm.segments[1].status == expected, mode


def test_none_mode_chunk_and_system_segment_share_identical_kv():
    # A segment computed alone at 0 is the same KV whether it is a system
    # prompt or a chunk in `none` mode, so the key is the same too.
    m = ChunkCacheManager(4, 4, context_mode=ChunkContextMode.NONE)
    finish_all(m, m.admit("r1", make_prompt(DOC_B, [30]), NS))
    adm = m.admit("r2", make_prompt(SYS, DOC_B, [31]), NS)
    assert adm.segments[1].status == SegmentStatus.RESIDENT


def test_cache_salt_isolates_tenants():
    m = ChunkCacheManager(num_pool_blocks=16, block_size=4)
    prompt = make_prompt(SYS, DOC_A, [30])
    finish_all(m, m.admit("r1", prompt, NS))
    salted = dataclasses.replace(NS, cache_salt="tenant-b")
    adm = m.admit("r2", prompt, salted)
    assert [s.status for s in adm.segments] == [SegmentStatus.MISSING] * 2


def test_hash_collision_falls_back_never_serves_other_tokens():
    m = ChunkCacheManager(num_pool_blocks=16, block_size=4)
    ha = h(DOC_A, [BOS])
    # Forced collision: DOC_A's key filed with other content.
    m.index.insert(ha, [99, 98], [BOS])
    adm = m.admit("r1", make_prompt(SYS, DOC_A, [30]), NS)
    assert adm.fallback
    stats = m.stats()
    assert (stats.hash_collisions, stats.fallbacks) == (1, 1)
    assert m.pool.usage().num_entries == 0


def test_api_misuse_is_reported():
    m = ChunkCacheManager(num_pool_blocks=16, block_size=4)
    m.admit("r1", make_prompt(SYS, [30]), NS)
    with pytest.raises(ValueError, match="already admitted"):
        m.admit("r1", make_prompt(SYS, [30]), NS)
    with pytest.raises(KeyError, match="not a chunk-cache parent"):
        m.load_plan("nope")
    with pytest.raises(KeyError, match="not a chunk-cache child"):
        m.child_finished("nope")
    with pytest.raises(KeyError, match="not a chunk-cache child"):
        m.store_plan("nope")
