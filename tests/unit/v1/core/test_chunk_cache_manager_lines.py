# SPDX-License-Identifier: Apache-2.0
"""Issue 52: the manager's all-hit path runs no Python per token.

The same request shape (a system prompt, eight documents, a question) with
documents of 16 and of 1,600 tokens, every document resident: arrival,
the step's decision (admission, the prefill plan, every segment's rows) and the
load plan execute the same number of
Python lines (`python_lines`: a count, not a time, so it holds on any machine
and under any load). A loop over tokens or rows would make the longer prompt
execute more; hashing, verification and block lists are C-level work.
"""

import random

from vllm.v1.core.chunk_cache_manager import ChunkCacheManager
from vllm.v1.core.chunk_structures import (
    ChunkContextMode,
    ChunkedPrompt,
    ChunkNamespace,
    SegmentSpan,
)

from tests.chunk_manager_views import child_finished
from tests.unit.python_lines import python_lines

NS = ChunkNamespace(model="m", kv_dtype="bfloat16", tokenizer="t")
BOS = 1
DOCS = 8


def _prompt(system, docs, question) -> ChunkedPrompt:
    segments = [system, *docs, question]
    spans, start = [], 0
    for seg in segments:
        spans.append(SegmentSpan(start, start + len(seg)))
        start += len(seg)
    return ChunkedPrompt([t for seg in segments for t in seg], tuple(spans))


def _all_hit_lines(doc_tokens: int) -> int:
    """Lines of one all-hit request's scheduler-side calls, the documents
    resident and shuffled anew."""
    rng = random.Random(doc_tokens)
    system = [BOS] + [rng.randrange(2, 1000) for _ in range(doc_tokens)]
    docs = [[rng.randrange(2, 1000) for _ in range(doc_tokens)] for _ in range(DOCS)]
    manager = ChunkCacheManager(
        4 * DOCS * (doc_tokens // 16 + 2), 16, ChunkContextMode.SINK, sink_token_id=BOS
    )
    manager.add_request("warm", _prompt(system, docs, [5, 6, 7]), NS)
    for child in manager.admit("warm").children:
        child_finished(manager, child.request_id)
    manager.release("warm")
    order = rng.sample(docs, len(docs))
    prompt = _prompt(system, order, [8, 9, 10])

    def request() -> None:
        manager.add_request("r", prompt, NS)
        decision = manager.decide("r")
        assert decision.ready, "every segment resident"
        plan = decision.load_plan(0, decision.plan.num_tokens)
        assert (
            sum(s.num_tokens for s in plan.segments) == len(system) + DOCS * doc_tokens
        )
        manager.release("r")

    request()  # first-call imports and caches
    return python_lines(request)


def test_the_all_hit_path_runs_no_python_per_token():
    assert _all_hit_lines(1600) == _all_hit_lines(16)
