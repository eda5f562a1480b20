# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Content keys of cached segments and the index from key to pool entry.

    key = xxh3_128(VERSION | namespace digest
                   | len(context) | context ids | len(tokens) | token ids)

Ids are fixed-width little-endian uint32, each list preceded by its length
(uint64), so no two (context, tokens) pairs serialise alike; the namespace
(`ChunkNamespace`) pins everything else the KV depends on; never a position.
The index (the pool's own) stores the serialised ids and compares them on
lookup: a collision is refused, never served wrong KV.
"""

import array
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from vllm.v1.core.chunk_structures import ChunkHash

# NOTE: 'I' is a 4-byte unsigned int on every platform vLLM runs on; where it
# is not, lists take numpy's path.
_ARRAY_U32 = array.array("I").itemsize == 4

# Bump when the serialisation changes so old keys can never match new ones.
_KEY_VERSION = b"vllm-chunk-cache-key-v1"
# Bytes an id takes in `token_bytes`.
TOKEN_ID_BYTES = 4
_RANGE_ERROR = "token ids must be in [0, 2**32) to be hashed"


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Fixed-width little-endian uint32 serialisation of token ids."""
    if isinstance(token_ids, np.ndarray) or not _ARRAY_U32:
        token_ids = np.asarray(token_ids)
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > 0xFFFFFFFF):
            raise ValueError(_RANGE_ERROR)
        return token_ids.astype("<u4", copy=False).tobytes()
    # NOTE: a list goes through array.array, ~5x faster than np.asarray for a
    # 512-token segment, and it checks the range itself (OverflowError).
    try:
        out = array.array("I", token_ids)
    except OverflowError:
        raise ValueError(_RANGE_ERROR) from None
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def compute_chunk_hash(
    token_ids: Sequence[int] | np.ndarray,
    context_ids: Sequence[int] | np.ndarray,
    namespace_digest: bytes,
) -> ChunkHash:
    """Position-independent key of one segment (see module docstring)."""
    return chunk_hash_of_bytes(
        token_bytes(token_ids), token_bytes(context_ids), namespace_digest
    )


def chunk_hash_of_bytes(
    tokens: bytes, context: bytes, namespace_digest: bytes
) -> ChunkHash:
    """`compute_chunk_hash` of ids already serialised by `token_bytes`."""
    # NOTE: one-shot over the joined parts: the digest of updating a hasher
    # part by part, in half the time.
    return ChunkHash(
        xxhash.xxh3_128_digest(
            b"".join(
                (
                    _KEY_VERSION,
                    namespace_digest,
                    (len(context) // TOKEN_ID_BYTES).to_bytes(8, "little"),
                    context,
                    (len(tokens) // TOKEN_ID_BYTES).to_bytes(8, "little"),
                    tokens,
                )
            )
        )
    )


@dataclass(frozen=True)
class IndexedChunk:
    """What the index remembers about a resident segment."""

    chunk_hash: ChunkHash
    # Segment and context ids as `token_bytes` serialises them (equal bytes
    # <=> equal ids: fixed width, unrepresentable ids refused).
    tokens: bytes
    context: bytes


class ChunkHashIndex:
    """Key -> published segment, verified on lookup."""

    def __init__(self) -> None:
        self._entries: dict[ChunkHash, IndexedChunk] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, chunk_hash: object) -> bool:
        return chunk_hash in self._entries

    def insert(
        self,
        chunk_hash: ChunkHash,
        token_ids: Sequence[int],
        context_ids: Sequence[int],
    ) -> None:
        if chunk_hash in self._entries:
            raise ValueError(f"chunk {chunk_hash.hex()} is already indexed")
        self._entries[chunk_hash] = IndexedChunk(
            chunk_hash, token_bytes(token_ids), token_bytes(context_ids)
        )

    def lookup_bytes(
        self, chunk_hash: ChunkHash, tokens: bytes, context: bytes
    ) -> IndexedChunk | None:
        """The entry for `chunk_hash` if its stored ids (serialised by
        `token_bytes`) equal the given ones; None on a collision (the caller
        tells it from an absent key with `in`)."""
        entry = self._entries.get(chunk_hash)
        if entry is None or entry.tokens != tokens or entry.context != context:
            return None
        return entry

    def remove(self, chunk_hash: ChunkHash) -> None:
        if self._entries.pop(chunk_hash, None) is None:
            raise KeyError(f"chunk {chunk_hash.hex()} is not indexed")
