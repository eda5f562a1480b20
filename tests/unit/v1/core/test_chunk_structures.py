# SPDX-License-Identifier: Apache-2.0
import pytest
from vllm.v1.core.chunk_structures import (
    ChunkCacheStats,
    ChunkedPrompt,
    SegmentSpan,
)


def test_chunked_prompt_views():
    prompt = ChunkedPrompt(
        [1, 2, 3, 4, 5, 6],
        (SegmentSpan(0, 2), SegmentSpan(2, 3), SegmentSpan(3, 5), SegmentSpan(5, 6)),
    )
    assert prompt.num_segments == 4 and prompt.num_chunks == 2
    assert prompt.system_span == SegmentSpan(0, 2)
    assert prompt.chunk_spans == (SegmentSpan(2, 3), SegmentSpan(3, 5))
    assert prompt.cached_spans[-1] == SegmentSpan(3, 5)
    assert prompt.question_span.num_tokens == 1
    assert prompt.segment_tokens(2) == [4, 5]


@pytest.mark.parametrize(
    "token_ids, spans, match",
    [
        ([1, 2], (SegmentSpan(0, 2),), "at least a system segment and a question"),
        ([1, 2], (SegmentSpan(0, 1), SegmentSpan(1, 1)), "segment 1 span"),
        ([1, 2, 3], (SegmentSpan(0, 1), SegmentSpan(2, 3)), "segment 1 span"),
        ([1, 2, 3], (SegmentSpan(0, 1), SegmentSpan(1, 2)), "end at 2 but .* 3 tokens"),
    ],
)
def test_chunked_prompt_rejects_bad_spans(token_ids, spans, match):
    with pytest.raises(ValueError, match=match):
        ChunkedPrompt(token_ids, spans)


def test_stats_ratios():
    empty = ChunkCacheStats()
    assert empty.hit_rate == 0.0 and empty.pool_usage == 0.0
    stats = ChunkCacheStats(
        hits=3, misses=1, in_flight_joins=0, pool_blocks_used=5, pool_blocks_total=20
    )
    assert stats.lookups == 4
    assert stats.hit_rate == 0.75 and stats.pool_usage == 0.25
