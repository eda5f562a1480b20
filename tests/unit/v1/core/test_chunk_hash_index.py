# SPDX-License-Identifier: Apache-2.0
import dataclasses
import struct

import numpy as np
import pytest
import xxhash
from vllm.v1.core.chunk_hash_index import (
    ChunkHashIndex,
    compute_chunk_hash,
    token_bytes,
)
from vllm.v1.core.chunk_structures import ChunkNamespace

NS = ChunkNamespace(model="tiny-llama", kv_dtype="bfloat16", tokenizer="tiny-llama")


def test_key_is_16_bytes_deterministic_and_input_type_agnostic():
    d = NS.digest()
    k = compute_chunk_hash([1, 2, 3], [0], d)
    assert isinstance(k, bytes) and len(k) == 16
    assert compute_chunk_hash(np.array([1, 2, 3]), (0,), NS.digest()) == k


def test_serialisation_is_fixed_width_little_endian_with_lengths():
    # Recompute the documented byte layout by hand with struct.
    d = NS.digest()
    data = (
        b"vllm-chunk-cache-key-v1"
        + d
        + struct.pack("<Q", 1)
        + struct.pack("<I", 5)
        + struct.pack("<Q", 2)
        + struct.pack("<2I", 258, 70000)
    )
    assert compute_chunk_hash([258, 70000], [5], d) == xxhash.xxh3_128(data).digest()
    assert token_bytes([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    # A list (array.array's path) and an ndarray (numpy's) serialise alike, as
    # struct writes little-endian uint32s.
    ids = [0, 7, 2**31 + 5, 2**32 - 1, 128_000]
    want = struct.pack("<5I", *ids)
    assert token_bytes(ids) == token_bytes(tuple(ids)) == want
    assert token_bytes(np.array(ids, dtype=np.int64)) == want


def test_context_and_token_boundary_is_unambiguous():
    d = NS.digest()
    assert compute_chunk_hash([2, 3], [1], d) != compute_chunk_hash([3], [1, 2], d)
    assert compute_chunk_hash([1, 2], [], d) != compute_chunk_hash([2], [1], d)


def test_context_changes_the_key():
    d = NS.digest()
    keys = {compute_chunk_hash([10, 11], ctx, d) for ctx in ([], [1], [2], [1, 5, 6])}
    assert len(keys) == 4


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"kv_dtype": "float16"},
        {"tokenizer": "other"},
        {"lora_name": "sql-adapter"},
        {"cache_salt": "tenant-a"},
        {"cache_salt": ""},
    ],
)
def test_every_namespace_field_changes_the_key(change):
    other = dataclasses.replace(NS, **change)
    assert other.digest() != NS.digest()
    assert compute_chunk_hash([1], [], other.digest()) != compute_chunk_hash(
        [1], [], NS.digest()
    )


def test_token_ids_out_of_range_are_rejected():
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        token_bytes([-1])
    with pytest.raises(ValueError):
        token_bytes([2**32])
    assert token_bytes([]) == b""


def test_lookup_verifies_tokens_so_a_collision_is_never_a_hit():
    index = ChunkHashIndex()
    k = compute_chunk_hash([1, 2, 3], [0], NS.digest())
    index.insert(k, [1, 2, 3], [0])
    assert len(index) == 1 and k in index
    hit = index.lookup_bytes(k, token_bytes([1, 2, 3]), token_bytes([0]))
    assert hit is not None and hit.tokens == token_bytes([1, 2, 3])
    # Forced collision: same key, other content -> no hit (the pool tells it
    # from an absent key: test_chunk_block_pool.py).
    assert index.lookup_bytes(k, token_bytes([9, 9, 9]), token_bytes([0])) is None
    assert index.lookup_bytes(k, token_bytes([1, 2, 3]), token_bytes([7])) is None
    other = compute_chunk_hash([4], [0], NS.digest())
    assert index.lookup_bytes(other, token_bytes([4]), token_bytes([0])) is None
    assert other not in index


def test_insert_twice_and_remove_unknown_fail():
    index = ChunkHashIndex()
    k = compute_chunk_hash([1], [], NS.digest())
    index.insert(k, [1], [])
    with pytest.raises(ValueError, match="already indexed"):
        index.insert(k, [1], [])
    index.remove(k)
    assert k not in index
    with pytest.raises(KeyError):
        index.remove(k)


def test_hash_of_serialised_ids_is_the_key_of_the_ids():
    from vllm.v1.core.chunk_hash_index import chunk_hash_of_bytes

    d = NS.digest()
    for tokens, context in (([1, 2, 3], [0]), ([2**32 - 1], []), ([], [5, 6])):
        assert chunk_hash_of_bytes(
            token_bytes(tokens), token_bytes(context), d
        ) == compute_chunk_hash(tokens, context, d)


def test_lookup_bytes_verifies_tokens_and_context_exactly():
    index = ChunkHashIndex()
    k = compute_chunk_hash([1, 70000, 3], [0], NS.digest())
    index.insert(k, [1, 70000, 3], [0])
    entry = index.lookup_bytes(k, token_bytes([1, 70000, 3]), token_bytes([0]))
    assert entry is not None
    # The stored bytes are the ids they were filed with.
    assert (entry.tokens, entry.context) == (token_bytes([1, 70000, 3]), b"\0" * 4)
    # Forced collisions: the key with other tokens or another context.
    assert index.lookup_bytes(k, token_bytes([1, 70001, 3]), token_bytes([0])) is None
    assert index.lookup_bytes(k, token_bytes([1, 70000]), token_bytes([0])) is None
    assert index.lookup_bytes(k, token_bytes([1, 70000, 3]), token_bytes([])) is None
    assert index.lookup_bytes(k, token_bytes([1, 70000, 3]), token_bytes([1])) is None
