# SPDX-License-Identifier: Apache-2.0
import math

import pytest
import torch

from vllm.v1.core.chunk_cache_manager import ChunkCacheManager
from vllm.v1.core.chunk_hash_index import ChunkNamespace
from vllm.v1.core.chunk_isolation_mask import build_isolated_sequence
from vllm.v1.core.chunk_structures import ChunkContextMode, ChunkedPrompt, SegmentSpan


def make_prompt(*segments):
    spans, start = [], 0
    for seg in segments:
        spans.append(SegmentSpan(start, start + len(seg)))
        start += len(seg)
    return ChunkedPrompt([t for seg in segments for t in seg], tuple(spans))


def as_rows(allowed: torch.Tensor) -> list[str]:
    return ["".join("1" if x else "." for x in row) for row in allowed[0, 0].tolist()]


# system [a b], chunk1 [c d], chunk2 [e], question [f]; final positions 0..5
PROMPT = make_prompt([1, 2], [3, 4], [5], [6])


def test_sink_mode_hand_worked():
    # The sink is the deployment's constant (9), not the prompt's first token.
    seq = build_isolated_sequence(PROMPT, ChunkContextMode.SINK, sink_token_id=9)
    # a b | s c d | s e | f
    assert seq.token_ids == [1, 2, 9, 3, 4, 9, 5, 6]
    assert seq.position_ids.tolist() == [0, 1, 1, 2, 3, 3, 4, 5]
    assert seq.source_index.tolist() == [0, 1, -1, 2, 3, -1, 4, 5]
    assert as_rows(seq.allowed) == [
        "1.......",
        "11......",
        "..1.....",  # the private sink sees only itself
        "..11....",
        "..111...",
        ".....1..",
        ".....11.",
        "11.11.11",  # the question never sees private copies
    ]
    assert seq.real_rows.tolist() == [0, 1, 3, 4, 6, 7]


def test_none_mode_hand_worked():
    seq = build_isolated_sequence(PROMPT, ChunkContextMode.NONE)
    assert seq.token_ids == [1, 2, 3, 4, 5, 6]
    assert seq.position_ids.tolist() == [0, 1, 2, 3, 4, 5]
    assert as_rows(seq.allowed) == [
        "1.....",
        "11....",
        "..1...",
        "..11..",
        "....1.",
        "111111",
    ]


def test_system_mode_with_generated_tokens_hand_worked():
    prompt = make_prompt([1, 2], [3], [6])
    seq = build_isolated_sequence(prompt, "system", extra_token_ids=[7])
    # a b | a' b' c | f | g  (the copy takes positions 0, 1 before c at 2)
    assert seq.token_ids == [1, 2, 1, 2, 3, 6, 7]
    assert seq.position_ids.tolist() == [0, 1, 0, 1, 2, 3, 4]
    assert seq.source_index.tolist() == [0, 1, -1, -1, 2, 3, 4]
    assert as_rows(seq.allowed) == [
        "1......",
        "11.....",
        "..1....",
        "..11...",
        "..111..",
        "11..11.",
        "11..111",  # a generated token follows the question's rule
    ]
    additive = seq.additive_mask(torch.float16)
    assert additive.shape == (1, 1, 7, 7) and additive.dtype == torch.float16
    assert additive[0, 0, 6, 4] == 0
    assert additive[0, 0, 6, 2] == torch.finfo(torch.float16).min


# --------------------------------------------------------------------------
# The mask is the definition; the engine realises it with child requests.
# One attention layer computed both ways must agree.

HEADS, HEAD = 2, 16


def attend(q, k, v, allowed):
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("mode", list(ChunkContextMode))
def test_reference_mask_equals_structural_child_computation(
    vllm_config_context, mode
):
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.position_remapper import RopeRotation

    rope = get_rope(HEAD, 256, True, {"rope_type": "default"}, torch.float32)
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 32, generator=gen)
    wq, wk, wv = (torch.randn(32, HEADS * HEAD, generator=gen) / 6 for _ in range(3))

    def project(token_ids, positions):
        x = emb[torch.tensor(token_ids)]
        q, k = rope.forward_native(positions, x @ wq, x @ wk)
        shape = (-1, HEADS, HEAD)
        return q.view(shape), k.view(shape), (x @ wv).view(shape)

    prompt = make_prompt([1, 2, 3], [10, 11, 12, 13], [20, 21], [10, 11, 12, 13],
                         [30, 31, 32])

    # Reference: one forward over the extended sequence with the mask.
    seq = build_isolated_sequence(prompt, mode, sink_token_id=7)
    q, k, v = project(seq.token_ids, seq.position_ids)
    ref = attend(q, k, v, seq.allowed[0, 0])[seq.real_rows]

    # Structural: children at child positions, then load + question.
    manager = ChunkCacheManager(num_pool_blocks=64, block_size=4, context_mode=mode,
                                sink_token_id=7)
    manager.add_request("r", prompt, ChunkNamespace("m", "f32", "t"))
    admission = manager.admit("r")
    stored, child_out = {}, {}
    for child in admission.new_children:
        n = len(child.token_ids)
        cq, ck, cv = project(child.token_ids, torch.arange(n))
        out = attend(cq, ck, cv, torch.ones(n, n, dtype=torch.bool).tril())
        s = child.store_start
        stored[child.chunk_hash] = (ck[s:], cv[s:])
        child_out[child.chunk_hash] = out[s:]
        manager.child_finished(child.request_id)
    plan = manager.load_plan("r")
    rotation = RopeRotation(rope)
    keys, values = [], []
    for seg in plan.segments:
        sk, sv = stored[seg.chunk_hash]
        deltas = torch.full((seg.num_tokens,), seg.position_delta)
        keys.append(rotation.rotate(sk, deltas))
        values.append(sv)
        # Every cached segment's own outputs match the reference rows.
        torch.testing.assert_close(
            child_out[seg.chunk_hash],
            ref[seg.dst_start : seg.dst_start + seg.num_tokens],
            atol=1e-5, rtol=1e-5,
        )
    question = prompt.question_span
    qq, qk, qv = project(prompt.segment_tokens(-1),
                         torch.arange(question.start, question.end))
    all_k = torch.cat(keys + [qk])
    all_v = torch.cat(values + [qv])
    allowed = torch.ones(question.num_tokens, question.end, dtype=torch.bool)
    allowed = allowed.tril(diagonal=question.start)
    out = attend(qq, all_k, all_v, allowed)
    torch.testing.assert_close(out, ref[question.start :], atol=1e-5, rtol=1e-5)
