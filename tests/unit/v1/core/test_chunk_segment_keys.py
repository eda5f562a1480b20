# SPDX-License-Identifier: Apache-2.0
"""Issue 52: admission serialises a prompt's cached ids once and hashes and
verifies each segment's slice of those bytes. The keys are the per-segment
keys of `compute_chunk_hash`, and a key that matches other content (tokens
or context) is still a collision: refused, never served."""

import pytest
from vllm.v1.core import chunk_cache_manager
from vllm.v1.core.chunk_cache_manager import ChunkCacheManager, segment_context
from vllm.v1.core.chunk_hash_index import compute_chunk_hash, token_bytes
from vllm.v1.core.chunk_structures import (
    AdmitReason,
    ChunkContextMode,
    ChunkedPrompt,
    ChunkNamespace,
    SegmentStatus,
)

from tests.chunk_manager_views import child_finished

NS = ChunkNamespace(model="m", kv_dtype="bfloat16", tokenizer="t")
SINK = 1
SYS = [SINK, 2, 70_000]
SYS2 = [SINK, 3, 70_000]
# Ids past 16 bits and at the top of uint32: a width or offset slip changes keys.
DOC_A = [10, 2**32 - 1, 65_536, 13, 14]
DOC_B = [20, 21]
DOC_C = [40, 41, 2**31 + 7, 43, 44, 45, 46, 47, 48]


def prompt(*segments) -> ChunkedPrompt:
    return ChunkedPrompt.from_lengths(
        [t for s in segments for t in s], [len(s) for s in segments]
    )


def manager(mode=ChunkContextMode.SINK) -> ChunkCacheManager:
    return ChunkCacheManager(64, 4, mode, sink_token_id=SINK)


def admit(m, rid, p):
    m.add_request(rid, p, NS)
    adm = m.admit(rid)
    return adm, adm.children


@pytest.mark.parametrize("mode", list(ChunkContextMode))
def test_keys_are_each_segments_own_key_in_every_mode(mode):
    p = prompt(SYS, DOC_A, DOC_B, DOC_A, DOC_C, [5, 6])
    adm, _ = admit(manager(mode), "r", p)
    assert adm.reason == AdmitReason.ADMITTED
    # The oracle: each segment's ids as lists, hashed one by one.
    want = [
        compute_chunk_hash(
            p.segment_tokens(i), segment_context(p, i, mode, SINK), NS.digest()
        )
        for i in range(len(p.cached_spans))
    ]
    assert [s.chunk_hash for s in adm.segments] == want
    assert want[1] == want[3] and len(set(want)) == 4


def _colliding(
    monkeypatch,
    victim: tuple[list[int], list[int]],
    impostor: tuple[list[int], list[int]],
) -> None:
    """The manager's hash files `impostor` (tokens, context) under `victim`'s key."""
    real = chunk_cache_manager.chunk_hash_of_bytes
    victim_bytes = tuple(map(token_bytes, victim))
    impostor_bytes = tuple(map(token_bytes, impostor))

    def colliding(tokens, context, ns_digest):
        if (tokens, context) == impostor_bytes:
            return real(*victim_bytes, ns_digest)
        return real(tokens, context, ns_digest)

    monkeypatch.setattr(chunk_cache_manager, "chunk_hash_of_bytes", colliding)


def _warm(m, p):
    adm, children = admit(m, "warm", p)
    assert adm.reason == AdmitReason.ADMITTED
    for child in children:
        child_finished(m, child.request_id)
    m.release("warm")


def test_other_tokens_under_a_resident_key_are_refused(monkeypatch):
    _colliding(monkeypatch, victim=(DOC_A, [SINK]), impostor=(DOC_C, [SINK]))
    m = manager()
    _warm(m, prompt(SYS, DOC_A, [5]))
    adm, children = admit(m, "clash", prompt(SYS, DOC_C, [6]))
    assert adm.reason == AdmitReason.COLLISION and children == ()
    stats = m.stats()
    assert (stats.hash_collisions, stats.refused_requests, stats.pinned_entries) == (
        1,
        1,
        0,
    )


def test_another_context_under_a_resident_key_is_refused(monkeypatch):
    # The same document after another system prompt (`system` mode): its
    # tokens match the entry, its context does not.
    _colliding(monkeypatch, victim=(DOC_A, SYS), impostor=(DOC_A, SYS2))
    m = manager(ChunkContextMode.SYSTEM)
    _warm(m, prompt(SYS, DOC_A, [5]))
    adm, _ = admit(m, "clash", prompt(SYS2, DOC_A, [6]))
    assert adm.reason == AdmitReason.COLLISION
    assert m.stats().hash_collisions == 1


def test_the_same_content_is_still_a_hit(monkeypatch):
    # The colliding hash leaves other content alone: a control for the two
    # tests above (their refusals come from the verification, not the patch).
    _colliding(monkeypatch, victim=(DOC_A, [SINK]), impostor=(DOC_C, [SINK]))
    m = manager()
    _warm(m, prompt(SYS, DOC_A, [5]))
    adm, _ = admit(m, "again", prompt(SYS, DOC_A, [6]))
    assert adm.reason == AdmitReason.ADMITTED
    assert [s.status for s in adm.segments] == [SegmentStatus.RESIDENT] * 2
