# SPDX-License-Identifier: Apache-2.0
"""Content keys of cached segments and the index from key to pool entry.

Key composition (ARCHITECTURE.md section 4), all hashed with xxh3-128:

    key = xxh3_128(VERSION | namespace digest
                   | len(context) | context ids | len(tokens) | token ids)

* token ids and context ids are fixed-width little-endian uint32, each list
  preceded by its length (uint64), so no two different (context, tokens)
  pairs serialise to the same bytes;
* the context is what the segment was computed after: the sink token
  (`sink` mode), the system segment (`system` mode), nothing (`none` mode
  and the system segment itself);
* the namespace pins everything else the KV depends on: model, dtype,
  LoRA adapter, tokenizer, and the per-request `cache_salt` (tenant
  isolation);
* the position is never part of the key: that is the point.

A 128-bit hash makes collisions astronomically unlikely, but the index
still stores the token ids (serialised as above) and compares them on
lookup (as nano-vllm does),
so a collision is found and the request refused (never served wrong KV, nor
another attention). The index is the pool's own (chunk_block_pool.py): an
entry leaves it with its blocks; the manager counts collisions.
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


@dataclass(frozen=True)
class ChunkNamespace:
    """Everything besides the tokens that the cached KV depends on."""

    # Model name or path (the weights).
    model: str
    # KV cache dtype, e.g. "bfloat16".
    kv_dtype: str
    # Tokenizer name or path (ids mean nothing without it).
    tokenizer: str
    # LoRA adapter name, "" when none (adapters change K/V). NOTE: the name,
    # as vLLM's prefix cache keys blocks: the integer id is a per-process
    # slot number that another deployment (or a reload) may give another
    # adapter.
    lora_name: str = ""
    # Per-request salt: requests with different salts never share entries.
    cache_salt: str | None = None
    # Cache resets so far (the manager's epoch): weights may have changed at
    # each, so KV from before one must never match a key after it.
    weights_epoch: int = 0

    def digest(self) -> bytes:
        h = xxhash.xxh3_128()
        for part in (self.model, self.kv_dtype, self.tokenizer, self.lora_name):
            _update_with_text(h, part)
        h.update(int(self.weights_epoch).to_bytes(8, "little"))
        # NOTE: None and "" must differ, hence the explicit presence byte.
        if self.cache_salt is None:
            h.update(b"\x00")
        else:
            h.update(b"\x01")
            _update_with_text(h, self.cache_salt)
        return h.digest()


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Fixed-width little-endian uint32 serialisation of token ids."""
    if isinstance(token_ids, np.ndarray) or not _ARRAY_U32:
        token_ids = np.asarray(token_ids)
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > 0xFFFFFFFF):
            raise ValueError("token ids must be in [0, 2**32) to be hashed")
        return token_ids.astype("<u4", copy=False).tobytes()
    # NOTE: a list goes through array.array, not np.asarray: ~5x faster for a
    # 512-token segment (9 vs 45 us here), and every segment of a prompt is
    # hashed on the request's path (issue 40, deliverable 4). array checks the
    # range itself (OverflowError).
    try:
        out = array.array("I", token_ids)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32) to be hashed") from None
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
    """`compute_chunk_hash` of ids already serialised by `token_bytes`
    (issue 52: the manager serialises a prompt once, then hashes and
    verifies each segment's slice of it)."""
    # NOTE: one-shot over the joined parts: the same digest as updating a
    # hasher part by part, without a hasher's state (half the time).
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

    # The key it is filed under.
    chunk_hash: ChunkHash
    # Exact segment token ids and context ids, as `token_bytes` serialises
    # them, compared on every lookup (equal bytes <=> equal ids: the
    # serialisation is fixed-width and refuses ids it cannot represent).
    tokens: bytes
    context: bytes

    @property
    def token_ids(self) -> tuple[int, ...]:
        return _ids_of(self.tokens)

    @property
    def context_ids(self) -> tuple[int, ...]:
        return _ids_of(self.context)


class ChunkHashIndex:
    """Key -> resident segment, with token verification on lookup."""

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

    def lookup(
        self,
        chunk_hash: ChunkHash,
        token_ids: Sequence[int],
        context_ids: Sequence[int],
    ) -> IndexedChunk | None:
        """The entry for `chunk_hash` if its stored ids equal the given ones.

        A key match with different ids is a hash collision: None, never a
        hit (the caller tells it from an absent key with `in`).
        """
        if chunk_hash not in self._entries:
            return None
        try:
            tokens, context = token_bytes(token_ids), token_bytes(context_ids)
        except ValueError:
            return None  # ids no entry can hold (insert refuses them)
        return self.lookup_bytes(chunk_hash, tokens, context)

    def lookup_bytes(
        self, chunk_hash: ChunkHash, tokens: bytes, context: bytes
    ) -> IndexedChunk | None:
        """`lookup` of ids already serialised by `token_bytes`: two byte
        comparisons."""
        entry = self._entries.get(chunk_hash)
        if entry is None or entry.tokens != tokens or entry.context != context:
            return None
        return entry

    def remove(self, chunk_hash: ChunkHash) -> None:
        if self._entries.pop(chunk_hash, None) is None:
            raise KeyError(f"chunk {chunk_hash.hex()} is not indexed")


def _ids_of(data: bytes) -> tuple[int, ...]:
    """The ids `token_bytes` serialised into `data`."""
    if not _ARRAY_U32:
        return tuple(int(t) for t in np.frombuffer(data, dtype="<u4"))
    out = array.array("I", data)
    if sys.byteorder != "little":
        out.byteswap()
    return tuple(out)


def _update_with_text(h: "xxhash.xxh3_128", text: str) -> None:
    data = text.encode("utf-8")
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
