# SPDX-License-Identifier: Apache-2.0
"""Prefix-cache keys of a chunked prompt's blocks (issue 20, finding 7): each
block is keyed by the segment boundaries inside it, so requests with the same
leading segments share those blocks and nothing else does."""

from __future__ import annotations

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.chunk_block_keys import block_extra_keys
from vllm.v1.request import Request

BLOCK = 4


def test_keys_name_each_boundary_in_the_block_with_its_kind():
    layout = (3, 5, 4, 2)  # system 0-2, chunk 3-7, chunk 8-11, question 12-13
    assert block_extra_keys(layout, 0, 4) == [
        ("chunk-segment", 0, "s"),
        ("chunk-segment", 3, "c"),
    ]
    assert block_extra_keys(layout, 4, 8) == []
    assert block_extra_keys(layout, 8, 12) == [("chunk-segment", 0, "c")]
    assert block_extra_keys(layout, 12, 16) == [("chunk-segment", 0, "q")]


def test_a_question_and_a_chunk_starting_at_the_same_place_differ():
    # sys ## doc ## X (X the question) vs sys ## doc ## X ## Y (X a document):
    # X's tokens attend to everything in the first, to X alone in the second.
    assert block_extra_keys((3, 5, 4), 8, 12) != block_extra_keys((3, 5, 4, 2), 8, 12)


@pytest.fixture(scope="module", autouse=True)
def _none_hash():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)  # the chain's seed: once, as the engine does


def _block_hashes(layout, token_ids):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    request = Request(
        "r",
        token_ids,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        chunk_layout=layout,
    )
    return request.block_hashes


def test_requests_share_the_blocks_of_their_common_leading_segments():
    """Before (layout digest in block 0's keys): a second question over the
    same system prompt and documents shared no block with the first."""
    docs = list(range(100, 112))  # system 3 + chunks 5 and 4: 12 tokens, 3 blocks
    first = _block_hashes((3, 5, 4, 6), docs + [7] * 6)
    second = _block_hashes((3, 5, 4, 9), docs + [8] * 9)
    assert first[:3] == second[:3]
    assert first[3] != second[3]
    # The same tokens as a causal request, or split otherwise: nothing shared.
    plain = _block_hashes(None, docs + [7] * 6)
    other = _block_hashes((3, 4, 5, 6), docs + [7] * 6)
    assert plain[0] != first[0]
    assert other[0] == first[0] and other[1] != first[1]


@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (16,), (4, 4, 4, 4)])
def test_block_edges_and_single_token_segments(layout):
    total = sum(layout)
    keys = [
        k
        for s in range(0, total, BLOCK)
        for k in block_extra_keys(layout, s, s + BLOCK)
    ]
    assert len(keys) == len(layout)
    assert keys[0] == ("chunk-segment", 0, "s")
    assert keys[-1][2] == ("q" if len(layout) > 1 else "s")


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_no_client_salt_shares_a_block_with_a_chunked_prompt(algo):
    """Issue 30, finding 6. Before: the keys were strings in the same list as
    cache_salt and the LoRA name, so a causal request salted "chunk-segment:0:s"
    hashed its first block as an unsalted chunked prompt whose first block is all
    system prompt: one client could share with, and probe, another's namespace.
    Now no string a client sends (salt, LoRA name, multimodal UUID) equals a key,
    under every hash vLLM offers (--prefix-caching-hash-algo)."""
    from vllm.utils import hashing
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = getattr(hashing, algo)
    init_none_hash(hash_fn)
    system = list(range(100, 100 + BLOCK))  # block 0: all system prompt

    def hashes(layout, salt):
        request = Request(
            "r",
            system + [7] * 6,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=get_request_block_hasher(BLOCK, hash_fn),
            cache_salt=salt,
            chunk_layout=layout,
        )
        return request.block_hashes

    chunked = hashes((BLOCK, 4, 2), None)
    shaped = [str(key) for key in block_extra_keys((BLOCK, 4, 2), 0, BLOCK)]
    shaped += ["chunk-segment:0:s", "('chunk-segment', 0, 's')", "chunk-segment"]
    for salt in shaped:
        assert hashes(None, salt)[0] != chunked[0], salt
    # A chunked prompt's salt keys its blocks too: a tenant's own hash differs.
    assert hashes((BLOCK, 4, 2), "tenant")[0] != chunked[0]
    init_none_hash(hashing.sha256)  # as the module fixture left it


def test_layouts_asked_in_turn_each_get_their_own_boundaries():
    """Issue 52: the starts are remembered for the last layout object asked
    for. Interleaved layouts, equal ones as distinct objects and a layout asked
    again after another all give the keys of a plain reading of the layout
    (each segment start's offset in the block, and its kind)."""

    def expected(layout, start, end):
        starts = [sum(layout[:i]) for i in range(len(layout))]
        return [
            (
                "chunk-segment",
                p - start,
                "s" if i == 0 else "q" if i == len(layout) - 1 else "c",
            )
            for i, p in enumerate(starts)
            if start <= p < end
        ]

    a, b = (3, 5, 4, 2), (2, 2, 2, 2, 6)
    a_again = tuple(list(a))  # equal content, another object
    for layout in (a, b, a, a_again, b, b, a_again):
        for start in range(0, 16, BLOCK):
            assert block_extra_keys(layout, start, start + BLOCK) == expected(
                layout, start, start + BLOCK
            )


def test_every_block_length_and_offset_gets_the_keys_of_a_plain_reading():
    """Issue 60: the keys of aligned blocks come from a table per (layout,
    block length), remembered for the last pair asked for. Random layouts,
    block lengths asked in turn (one token to longer than the prompt), aligned
    and unaligned blocks, and the last block cut short: each equals a plain
    reading of the layout (every segment start in [start, end), its offset
    and its kind)."""
    import random

    def expected(layout, start, end):
        starts = [sum(layout[:i]) for i in range(len(layout))]
        return [
            (
                "chunk-segment",
                p - start,
                "s" if i == 0 else "q" if i == len(layout) - 1 else "c",
            )
            for i, p in enumerate(starts)
            if start <= p < end
        ]

    rng = random.Random(60)
    layouts = [
        tuple(rng.randint(1, 40) for _ in range(rng.randint(2, 12))) for _ in range(20)
    ]
    checked = 0
    for _ in range(3):
        for layout in layouts:
            total = sum(layout)
            for length in (1, 3, 16, 32, 128, total + 5):
                for start in range(0, total, length):
                    assert block_extra_keys(layout, start, start + length) == expected(
                        layout, start, start + length
                    )
                    checked += 1
                start = rng.randrange(1, total) if total > 1 else 0
                end = start + rng.randint(1, 50)
                assert block_extra_keys(layout, start, end) == expected(
                    layout, start, end
                )
    assert checked > 1000
