# SPDX-License-Identifier: Apache-2.0
import math

import pytest
import torch
from vllm.v1.core.chunk_cache_manager import ChunkCacheManager
from vllm.v1.core.chunk_structures import (
    ChunkContextMode,
    ChunkedPrompt,
    ChunkNamespace,
    SegmentSpan,
)

from tests.chunk_isolation_mask import (
    Role,
    build_isolated_sequence,
    build_lever_sequence,
    first_k,
)
from tests.chunk_manager_views import child_finished, load_plan


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


def test_sliding_window_hand_worked():
    """Issue 42 (docs/design/sliding-window.md): a layer with a window of W keys
    sees, of what the isolation mask allows, the keys with pos_q - pos_k < W."""
    seq = build_isolated_sequence(PROMPT, ChunkContextMode.SINK, sink_token_id=9)
    # a b | s c d | s e | f   at positions 0 1 | 1 2 3 | 3 4 | 5
    assert as_rows(seq.windowed(2)) == [
        "1.......",
        "11......",
        "..1.....",
        "..11....",
        "...11...",  # d (3): its sink (1) left the window, c (2) did not
        ".....1..",
        ".....11.",
        "......11",  # the question (5): e (4) and itself, the last 2 real keys
    ]
    assert torch.equal(
        seq.windowed(6), seq.allowed
    )  # a window over the prompt: no change
    additive = seq.additive_mask(torch.float32, window=2)
    assert torch.equal(additive == 0, seq.windowed(2))


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
def test_reference_mask_equals_structural_child_computation(vllm_config_context, mode):
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

    prompt = make_prompt(
        [1, 2, 3], [10, 11, 12, 13], [20, 21], [10, 11, 12, 13], [30, 31, 32]
    )

    # Reference: one forward over the extended sequence with the mask.
    seq = build_isolated_sequence(prompt, mode, sink_token_id=7)
    q, k, v = project(seq.token_ids, seq.position_ids)
    ref = attend(q, k, v, seq.allowed[0, 0])[seq.real_rows]

    # Structural: children at child positions, then load + question.
    manager = ChunkCacheManager(
        num_pool_blocks=64, block_size=4, context_mode=mode, sink_token_id=7
    )
    manager.add_request("r", prompt, ChunkNamespace("m", "f32", "t"))
    admission = manager.admit("r")
    stored, child_out = {}, {}
    for child in admission.children:
        n = len(child.token_ids)
        cq, ck, cv = project(child.token_ids, torch.arange(n))
        out = attend(cq, ck, cv, torch.ones(n, n, dtype=torch.bool).tril())
        s = child.store_start
        stored[child.chunk_hash] = (ck[s:], cv[s:])
        child_out[child.chunk_hash] = out[s:]
        child_finished(manager, child.request_id)
    plan = load_plan(manager, "r")
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
            atol=1e-5,
            rtol=1e-5,
        )
    question = prompt.question_span
    qq, qk, qv = project(
        prompt.segment_tokens(-1), torch.arange(question.start, question.end)
    )
    all_k = torch.cat(keys + [qk])
    all_v = torch.cat(values + [qv])
    allowed = torch.ones(question.num_tokens, question.end, dtype=torch.bool)
    allowed = allowed.tril(diagonal=question.start)
    out = attend(qq, all_k, all_v, allowed)
    torch.testing.assert_close(out, ref[question.start :], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------
# Recompute levers: build_lever_sequence and the boundary lever
# (build_isolated_sequence(..., recompute_tokens=K)).

SINK = 7
# system [10 11], chunks [12 13 14] [15 16 17 18] [19 20], question [21 22]
LEVER_PROMPT = ChunkedPrompt.from_lengths(list(range(10, 23)), [2, 3, 4, 2, 2])


def assert_same(a, b):
    assert a.token_ids == b.token_ids
    assert torch.equal(a.position_ids, b.position_ids)
    assert torch.equal(a.allowed, b.allowed)
    assert torch.equal(a.source_index, b.source_index)


@pytest.mark.parametrize("mode", ["none", "sink", "system"])
def test_no_recompute_is_the_isolation_mask(mode):
    lever = build_lever_sequence(
        LEVER_PROMPT, mode, [[], [], []], extra_token_ids=[30, 31], sink_token_id=SINK
    )
    ref = build_isolated_sequence(
        LEVER_PROMPT, mode, extra_token_ids=[30, 31], sink_token_id=SINK
    )
    assert_same(lever.seq, ref)
    assert lever.num_recomputed == 0
    # recompute_tokens=0 is the default, i.e. the isolation mask itself.
    assert_same(
        build_isolated_sequence(
            LEVER_PROMPT,
            mode,
            extra_token_ids=[30, 31],
            sink_token_id=SINK,
            recompute_tokens=0,
        ),
        ref,
    )


@pytest.mark.parametrize("mode", ["none", "sink", "system"])
def test_full_recompute_is_causal_attention(mode):
    lever = build_lever_sequence(
        LEVER_PROMPT,
        mode,
        first_k(LEVER_PROMPT, 100),
        extra_token_ids=[30],
        sink_token_id=SINK,
    )
    seq = lever.seq
    real = seq.real_rows
    assert [seq.token_ids[i] for i in real] == LEVER_PROMPT.token_ids + [30]
    assert seq.position_ids[real].tolist() == list(
        range(len(LEVER_PROMPT.token_ids) + 1)
    )
    sub = seq.allowed[0, 0][real][:, real]
    assert torch.equal(sub, torch.ones_like(sub).tril())
    # No real token sees a private copy.
    assert not seq.allowed[0, 0][real][:, seq.source_index < 0].any()
    assert lever.num_recomputed == 9


def test_partial_recompute_hand_worked():
    # Sink mode; chunk 1 recomputes its 2nd token (13), chunk 3 its 2nd (20).
    lever = build_lever_sequence(
        LEVER_PROMPT, "sink", [[1], [], [1]], sink_token_id=SINK
    )
    assert [r.value for r in lever.roles] == [
        "system",
        "system",
        "context",
        "isolated",
        "cached",
        "recomputed",
        "cached",
        "context",
        "cached",
        "cached",
        "cached",
        "cached",
        "context",
        "isolated",
        "cached",
        "recomputed",
        "open",
        "open",
    ]
    assert lever.seq.token_ids == [
        10,
        11,
        7,
        13,
        12,
        13,
        14,
        7,
        15,
        16,
        17,
        18,
        7,
        20,
        19,
        20,
        21,
        22,
    ]
    assert lever.seq.position_ids.tolist() == [
        0,
        1,
        1,
        3,
        2,
        3,
        4,
        4,
        5,
        6,
        7,
        8,
        8,
        10,
        9,
        10,
        11,
        12,
    ]
    assert as_rows(lever.seq.allowed) == [
        "1.................",
        "11................",
        "..1...............",  # sink
        "..111.............",  # isolated copy of 13: sink, 12, itself
        "..1.1.............",  # 12 (cached): sink, itself
        "11..11............",  # 13 recomputed: the system, 12, itself - no copies
        "..111.1...........",  # 14 (cached): sink, the *isolated* 13, 12, itself
        ".......1..........",
        ".......11.........",
        ".......111........",
        ".......1111.......",
        ".......11111......",
        "............1.....",
        "............111...",
        "............1.1...",
        "11..111.1111..11..",  # 20 recomputed: every real token before it
        "11..111.1111..111.",  # question: every real token
        "11..111.1111..1111",
    ]


def test_lever_argument_errors():
    with pytest.raises(ValueError, match="recompute sets"):
        build_lever_sequence(LEVER_PROMPT, "none", [[], []])
    with pytest.raises(ValueError, match="out of range"):
        build_lever_sequence(LEVER_PROMPT, "none", [[], [], [2]])
    with pytest.raises(ValueError, match="sink"):
        build_lever_sequence(LEVER_PROMPT, "sink", [[], [], []])
    with pytest.raises(ValueError, match="sink"):
        build_isolated_sequence(LEVER_PROMPT, "sink", recompute_tokens=2)
    with pytest.raises(ValueError, match="recompute_tokens"):
        build_isolated_sequence(LEVER_PROMPT, "none", recompute_tokens=-1)


def test_first_k():
    assert first_k(LEVER_PROMPT, 3) == [[0, 1, 2], [0, 1, 2], [0, 1]]
    assert first_k(LEVER_PROMPT, 0) == [[], [], []]
    assert first_k(LEVER_PROMPT, 100) == [[0, 1, 2], [0, 1, 2, 3], [0, 1]]


# system [1 2] (pos 0 1), chunk1 [3 4 5] (2..4), chunk2 [6 7 8] (5..7), question [9] (8)
K_PROMPT = make_prompt([1, 2], [3, 4, 5], [6, 7, 8], [9])
SINK_ID = 50


def test_boundary_recompute_sink_hand_worked():
    seq = build_isolated_sequence(
        K_PROMPT,
        "sink",
        extra_token_ids=[60],
        sink_token_id=SINK_ID,
        recompute_tokens=2,
    )
    # a b | s 3' 4' 3 4 5 | s 6' 7' 6 7 8 | 9 g   (x' = private isolated copy of x)
    assert seq.token_ids == [1, 2, 50, 3, 4, 3, 4, 5, 50, 6, 7, 6, 7, 8, 9, 60]
    assert seq.position_ids.tolist() == [0, 1, 1, 2, 3, 2, 3, 4, 4, 5, 6, 5, 6, 7, 8, 9]
    assert seq.source_index.tolist() == [
        0,
        1,
        -1,
        -1,
        -1,
        2,
        3,
        4,
        -1,
        -1,
        -1,
        5,
        6,
        7,
        8,
        9,
    ]
    assert as_rows(seq.allowed) == [
        "1...............",
        "11..............",
        "..1.............",  # chunk 1's sink
        "..11............",  # 3': sink, itself
        "..111...........",  # 4': sink, 3', itself
        "11...1..........",  # 3 recomputed: the system, itself
        "11...11.........",  # 4 recomputed: the system, 3, itself
        "..111..1........",  # 5 cached: sink, 3', 4' (never the real 3 4), itself
        "........1.......",  # chunk 2's sink
        "........11......",
        "........111.....",
        "11...111...1....",  # 6 recomputed: system and all of chunk 1 (real), itself
        "11...111...11...",
        "........111..1..",  # 8 cached: its sink and 6' 7' only
        "11...111...1111.",  # question: every real token, no private copy
        "11...111...11111",  # generated token: the question's rule
    ]
    assert seq.real_rows.tolist() == [0, 1, 5, 6, 7, 11, 12, 13, 14, 15]


def test_boundary_recompute_none_and_system_modes():
    none = build_isolated_sequence(K_PROMPT, "none", recompute_tokens=2)
    # a b | 3' 4' 3 4 5 | 6' 7' 6 7 8 | 9
    assert none.token_ids == [1, 2, 3, 4, 3, 4, 5, 6, 7, 6, 7, 8, 9]
    assert none.position_ids.tolist() == [0, 1, 2, 3, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    allowed = none.allowed[0, 0]
    assert (
        allowed[6].tolist()
        == [False, False, True, True, False, False, True] + [False] * 6
    )
    assert (
        allowed[9, :9].tolist() == [True] * 2 + [False] * 2 + [True] * 3 + [False] * 2
    )
    assert allowed[11].tolist() == [False] * 7 + [True, True, False, False, True, False]
    assert allowed[12].tolist() == [
        True,
        True,
        False,
        False,
        True,
        True,
        True,
        False,
        False,
        True,
        True,
        True,
        True,
    ]

    system = build_isolated_sequence(K_PROMPT, "system", recompute_tokens=2)
    # a b | a' b' 3' 4' 3 4 5 | a' b' 6' 7' 6 7 8 | 9
    assert system.token_ids == [1, 2, 1, 2, 3, 4, 3, 4, 5, 1, 2, 6, 7, 6, 7, 8, 9]
    assert system.position_ids.tolist() == [
        0,
        1,
        0,
        1,
        2,
        3,
        2,
        3,
        4,
        3,
        4,
        5,
        6,
        5,
        6,
        7,
        8,
    ]
    assert system.source_index.tolist() == [
        0,
        1,
        -1,
        -1,
        -1,
        -1,
        2,
        3,
        4,
        -1,
        -1,
        -1,
        -1,
        5,
        6,
        7,
        8,
    ]
    allowed = system.allowed[0, 0]
    # 3 (recomputed) sees the real system, not chunk 1's system copy.
    assert allowed[6, :2].all() and not allowed[6, 2:6].any() and allowed[6, 6]
    # 5 (cached) sees its system copy and 3' 4', not the real system nor the real 3 4.
    assert allowed[8].nonzero().flatten().tolist() == [2, 3, 4, 5, 8]
    # 6 (recomputed, chunk 2) sees the system and every real token of chunk 1.
    assert allowed[13].nonzero().flatten().tolist() == [0, 1, 6, 7, 8, 13]
    # 8 (cached, chunk 2) sees only its own copies: a' b' 6' 7' and itself.
    assert allowed[15].nonzero().flatten().tolist() == [9, 10, 11, 12, 15]
    # The question sees every real token and no private copy.
    assert allowed[16].nonzero().flatten().tolist() == [0, 1, 6, 7, 8, 13, 14, 15, 16]


@pytest.mark.parametrize("mode", ["none", "sink", "system"])
@pytest.mark.parametrize("k", [3, 4, 100])
def test_boundary_recompute_of_whole_chunks_is_causal(mode, k):
    seq = build_isolated_sequence(
        K_PROMPT, mode, extra_token_ids=[60], sink_token_id=SINK_ID, recompute_tokens=k
    )
    real = seq.real_rows
    assert [seq.token_ids[i] for i in real] == K_PROMPT.token_ids + [60]
    assert seq.position_ids[real].tolist() == list(range(10))
    sub = seq.allowed[0, 0][real][:, real]
    assert torch.equal(sub, torch.ones_like(sub).tril())
    # Every chunk is recomputed whole: no real token sees any private copy.
    assert not seq.allowed[0, 0][real][:, seq.source_index < 0].any()
    assert_same(
        seq,
        build_isolated_sequence(
            K_PROMPT,
            mode,
            extra_token_ids=[60],
            sink_token_id=SINK_ID,
            recompute_tokens=3,
        ),
    )


@pytest.mark.parametrize("mode", ["none", "sink", "system"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_boundary_recompute_is_the_first_k_lever(mode, k):
    lever = build_lever_sequence(
        LEVER_PROMPT,
        mode,
        first_k(LEVER_PROMPT, k),
        extra_token_ids=[30],
        sink_token_id=SINK,
    )
    seq = build_isolated_sequence(
        LEVER_PROMPT, mode, extra_token_ids=[30], sink_token_id=SINK, recompute_tokens=k
    )
    assert_same(seq, lever.seq)
    assert lever.num_recomputed == sum(
        min(k, s.num_tokens) for s in LEVER_PROMPT.chunk_spans
    )
    assert lever.roles.count(Role.ISOLATED) == lever.num_recomputed


@pytest.mark.parametrize("mode", list(ChunkContextMode))
def test_boundary_recompute_equals_structural_two_layer_computation(mode):
    """The lever as an engine would realise it: each chunk computed alone in a
    child (context + chunk; every layer's K/V of the chunk kept), then the request
    computes the system, the first K tokens of every chunk and the question layer
    by layer against the kept K/V of the cached tokens. Two layers, so that a
    cached token's K/V (isolated) differs from a recomputed one's."""
    gen = torch.Generator().manual_seed(0)
    dim, layers = HEADS * HEAD, 2
    emb = torch.randn(64, dim, generator=gen)
    weights = [
        [torch.randn(dim, dim, generator=gen) / 4 for _ in range(3)]
        for _ in range(layers)
    ]
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, HEAD, 2).float() / HEAD))

    def rope(x, positions):  # [n, HEADS, HEAD], rotate-half RoPE
        angle = positions.float()[:, None] * inv_freq[None, :]
        cos = torch.cat([angle.cos()] * 2, -1)[:, None]
        sin = torch.cat([angle.sin()] * 2, -1)[:, None]
        half = torch.cat([-x[..., HEAD // 2 :], x[..., : HEAD // 2]], -1)
        return x * cos + half * sin

    def qkv(layer, h, positions):
        wq, wk, wv = weights[layer]
        shape = (-1, HEADS, HEAD)
        return (
            rope((h @ wq).view(shape), positions),
            rope((h @ wk).view(shape), positions),
            (h @ wv).view(shape),
        )

    def forward(token_ids, positions, allowed):
        """Per layer: hidden input and K/V of every token; final hidden states."""
        h, kv = emb[torch.tensor(token_ids)], []
        for layer in range(layers):
            q, k, v = qkv(layer, h, positions)
            kv.append((k, v))
            h = h + attend(q, k, v, allowed).reshape(h.shape)
        return h, kv

    k_rec = 2
    prompt = make_prompt([1, 2, 3], [10, 11, 12, 13], [20], [30, 31, 32], [40, 41])
    seq = build_isolated_sequence(prompt, mode, sink_token_id=7, recompute_tokens=k_rec)
    ref, _ = forward(seq.token_ids, seq.position_ids, seq.allowed[0, 0])
    ref = ref[seq.real_rows]

    # Children: context + chunk at the chunk's real positions, causal.
    system = prompt.segment_tokens(0)
    n = len(prompt.token_ids)
    cached_kv = [[None] * n for _ in range(layers)]
    cached_out = {}
    for index, span in enumerate(prompt.chunk_spans, start=1):
        context = (
            [7]
            if mode == ChunkContextMode.SINK
            else system
            if mode == ChunkContextMode.SYSTEM
            else []
        )
        ids = context + prompt.segment_tokens(index)
        pos = torch.arange(span.start - len(context), span.end)
        m = len(ids)
        h, kv = forward(ids, pos, torch.ones(m, m, dtype=torch.bool).tril())
        for j in range(span.num_tokens):
            if j >= k_rec:  # cached: the child's K/V and output are kept
                for layer in range(layers):
                    k, v = kv[layer]
                    cached_kv[layer][span.start + j] = (
                        k[len(context) + j],
                        v[len(context) + j],
                    )
                cached_out[span.start + j] = h[len(context) + j]

    # The request: every other token computed, attending causally to all.
    computed = [i for i in range(n) if i not in cached_out]
    pos = torch.arange(n)
    h = emb[torch.tensor(prompt.token_ids)][computed]
    causal = torch.ones(n, n, dtype=torch.bool).tril()[computed]
    for layer in range(layers):
        q, k, v = qkv(layer, h, pos[computed])
        keys = torch.zeros(n, HEADS, HEAD)
        values = torch.zeros(n, HEADS, HEAD)
        keys[computed], values[computed] = k, v
        for i in cached_out:
            keys[i], values[i] = cached_kv[layer][i]
        h = h + attend(q, keys, values, causal).reshape(h.shape)

    torch.testing.assert_close(h, ref[computed], atol=1e-4, rtol=1e-4)
    for i, out in cached_out.items():
        torch.testing.assert_close(out, ref[i], atol=1e-4, rtol=1e-4)
    # The lever matters here: plain isolation gives other question outputs.
    iso = build_isolated_sequence(prompt, mode, sink_token_id=7)
    iso_out, _ = forward(iso.token_ids, iso.position_ids, iso.allowed[0, 0])
    assert not torch.allclose(iso_out[iso.real_rows][-1], ref[-1], atol=1e-3)


@torch.inference_mode()
def test_levers_on_a_tiny_model():
    """Numerically: no recompute gives the mode's outputs, full recompute gives
    plain causal attention's (a random 2-layer Llama, no engine)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=40,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation="eager",
        )
    ).eval()

    def run(seq):
        logits = model(
            input_ids=torch.tensor([seq.token_ids]),
            position_ids=seq.position_ids[None],
            attention_mask=seq.additive_mask(torch.float32),
        ).logits[0]
        return logits[seq.real_rows]

    causal = model(input_ids=torch.tensor([LEVER_PROMPT.token_ids])).logits[0]
    full = run(
        build_isolated_sequence(
            LEVER_PROMPT, "sink", sink_token_id=SINK, recompute_tokens=100
        )
    )
    torch.testing.assert_close(full, causal, atol=1e-5, rtol=1e-5)
    none = run(
        build_lever_sequence(
            LEVER_PROMPT, "sink", first_k(LEVER_PROMPT, 0), sink_token_id=SINK
        ).seq
    )
    iso = run(build_isolated_sequence(LEVER_PROMPT, "sink", sink_token_id=SINK))
    torch.testing.assert_close(none, iso)
    assert not torch.allclose(none[-1], causal[-1], atol=1e-3)  # isolation matters here
    # Boundary recompute lies in between: neither isolation nor causal attention.
    k2 = run(
        build_isolated_sequence(
            LEVER_PROMPT, "sink", sink_token_id=SINK, recompute_tokens=2
        )
    )
    assert not torch.allclose(k2[-1], iso[-1], atol=1e-4)
    assert not torch.allclose(k2[-1], causal[-1], atol=1e-4)
