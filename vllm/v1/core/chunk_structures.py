# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Typed identities and plain data shared by the chunk-cache modules (parser ->
manager -> connector -> worker). Imports nothing from vLLM: engine-free."""

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NewType

# A 16-byte xxh3-128 digest of a segment's content, its private context and
# the namespace it was computed in; never a position (chunk_hash_index.py).
ChunkHash = NewType("ChunkHash", bytes)

# Index of a block of the chunk pool (not of vLLM's paged KV cache).
PoolBlockId = NewType("PoolBlockId", int)


@dataclass(frozen=True)
class ChunkNamespace:
    """Everything besides the tokens that the cached KV depends on."""

    # Model name or path (the weights).
    model: str
    # KV cache dtype, e.g. "bfloat16".
    kv_dtype: str
    # Tokenizer name or path (ids mean nothing without it).
    tokenizer: str
    # LoRA adapter name, "" when none. NOTE: the name, as vLLM's prefix cache
    # keys blocks: the integer id is a per-process slot number.
    lora_name: str = ""
    # Per-request salt: requests with different salts never share entries.
    cache_salt: str | None = None
    # Cache resets so far (the manager's epoch): the weights may have changed
    # at each, so KV from before one never matches a key after it.
    weights_epoch: int = 0

    def digest(self) -> bytes:
        # NOTE: imported here: the front end imports this module, never hashes.
        import xxhash

        h = xxhash.xxh3_128()

        def text(value: str) -> None:
            data = value.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)

        for part in (self.model, self.kv_dtype, self.tokenizer, self.lora_name):
            text(part)
        h.update(int(self.weights_epoch).to_bytes(8, "little"))
        # NOTE: None and "" must differ, hence the presence byte.
        if self.cache_salt is None:
            h.update(b"\x00")
        else:
            h.update(b"\x01")
            text(self.cache_salt)
        return h.digest()


class ChunkContextMode(str, Enum):
    """What a chunk is computed after (ARCHITECTURE.md section 3)."""

    # The chunk alone, at virtual positions 0..L-1.
    NONE = "none"
    # [the deployment's sink token] + chunk; the chunk's rows start at 1.
    SINK = "sink"
    # [system segment] + chunk; the key includes the system tokens.
    SYSTEM = "system"


@dataclass(frozen=True)
class SegmentSpan:
    """Half-open token range [start, end) of one segment in a prompt."""

    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ChunkedPrompt:
    """A prompt split into segments: system, chunks..., question. `spans`
    partitions `token_ids` (separators removed) into contiguous non-empty
    segments; every segment but the question is cached by content."""

    token_ids: list[int]
    spans: tuple[SegmentSpan, ...]

    def __post_init__(self) -> None:
        if len(self.spans) < 2:
            raise ValueError(
                "a chunked prompt needs at least a system segment and a "
                f"question, got {len(self.spans)} segment(s)"
            )
        expected_start = 0
        for index, span in enumerate(self.spans):
            if span.start != expected_start or span.end <= span.start:
                raise ValueError(
                    f"segment {index} span [{span.start}, {span.end}) is not "
                    f"a non-empty range starting at {expected_start}"
                )
            expected_start = span.end
        if expected_start != len(self.token_ids):
            raise ValueError(
                f"segment spans end at {expected_start} but the prompt has "
                f"{len(self.token_ids)} tokens"
            )

    @classmethod
    def from_lengths(
        cls, token_ids: list[int], lengths: Sequence[int]
    ) -> "ChunkedPrompt":
        """The prompt whose consecutive segments have these token counts."""
        spans, start = [], 0
        for length in lengths:
            spans.append(SegmentSpan(start, start + int(length)))
            start += int(length)
        return cls(token_ids=list(token_ids), spans=tuple(spans))

    @property
    def segment_lengths(self) -> tuple[int, ...]:
        return tuple(span.num_tokens for span in self.spans)

    @property
    def num_segments(self) -> int:
        return len(self.spans)

    @property
    def num_chunks(self) -> int:
        """Number of document chunks (system and question excluded)."""
        return len(self.spans) - 2

    @property
    def system_span(self) -> SegmentSpan:
        return self.spans[0]

    @property
    def chunk_spans(self) -> tuple[SegmentSpan, ...]:
        return self.spans[1:-1]

    @property
    def question_span(self) -> SegmentSpan:
        return self.spans[-1]

    @property
    def cached_spans(self) -> tuple[SegmentSpan, ...]:
        """Segments served from the chunk cache: system + chunks."""
        return self.spans[:-1]

    def segment_tokens(self, index: int) -> list[int]:
        span = self.spans[index]
        return self.token_ids[span.start : span.end]


@dataclass
class ChunkPoolEntry:
    """One cached segment's rows in the chunk pool: row i lives in block
    block_ids[i // block_size] at offset i % block_size. While pin_count > 0
    (its writer, the requests that will load it) it is never evicted."""

    chunk_hash: ChunkHash
    block_ids: list[PoolBlockId]
    num_tokens: int
    pin_count: int = 0


class AdmitReason(str, Enum):
    """Outcome of `ChunkCacheManager.admit` for a chunked request."""

    # Pins taken, missing segments handed to children.
    ADMITTED = "admitted"
    # Not now: the pool is pinned full, or an earlier request still waits.
    DEFERRED = "deferred"
    # Refused: its distinct segments need more blocks than the whole pool.
    OVERSIZED = "oversized"
    # Refused: a key matched different tokens.
    COLLISION = "collision"
    # Refused: a child computing one of its segments failed twice.
    CHILD_FAILED = "child_failed"

    @property
    def refused(self) -> bool:
        return self not in (AdmitReason.ADMITTED, AdmitReason.DEFERRED)


@dataclass(frozen=True)
class ChunkRefusal:
    """A chunked request the engine must finish with an error."""

    request_id: str
    reason: AdmitReason
    # What the client is told (numbers and the flag to change, if any).
    message: str


class SegmentStatus(str, Enum):
    """Where a cached segment stands when a request is admitted."""

    # KV is in the pool and verified.
    RESIDENT = "resident"
    # A child request is computing it right now.
    IN_FLIGHT = "in_flight"
    # Nobody has it: a new child request must compute it.
    MISSING = "missing"


@dataclass(frozen=True)
class ChildSpec:
    """An internal prefill-only request that computes one segment's KV."""

    request_id: str
    chunk_hash: ChunkHash
    # Tokens the child prefills: private context + segment; rows
    # [store_start, len(token_ids)) go to the pool (store_start = len(context)).
    token_ids: list[int]
    store_start: int
    # Its entry's pool blocks, in row order (fixed for the child's life).
    pool_block_ids: tuple[PoolBlockId, ...] = ()
    # The namespace its key was made in (its store entry's tenant).
    namespace: ChunkNamespace | None = None
    # Opaque: what the engine glue builds the child's request from (client,
    # priority, LoRA request...), so that no parent request is kept for it.
    origin: Any = None


@dataclass(frozen=True)
class SegmentLoad:
    """One cached segment to copy from the pool into a request's KV."""

    chunk_hash: ChunkHash
    segment_index: int
    pool_block_ids: list[PoolBlockId]
    num_tokens: int
    # Position its first row was computed at in the child (0 or len(ctx)).
    stored_start: int
    # Position of its first row in the request (its span start).
    dst_start: int
    # Rows [first_row, end_row) are copied: rows before are in the request's
    # paged KV already (vLLM's prefix cache, an earlier stretch), rows after
    # are loaded later or recomputed (end_row None: num_tokens).
    first_row: int = 0
    end_row: int | None = None

    @property
    def row_end(self) -> int:
        return self.num_tokens if self.end_row is None else self.end_row

    @property
    def position_delta(self) -> int:
        """Rotate K by this many positions: real_start - stored_start."""
        return self.dst_start - self.stored_start


@dataclass(frozen=True)
class ChunkLoadPlan:
    """Worker instruction: fill a request's KV from the chunk pool."""

    request_id: str
    segments: tuple[SegmentLoad, ...]

    @property
    def num_rows_to_copy(self) -> int:
        return sum(s.row_end - s.first_row for s in self.segments)


@dataclass
class ChunkCacheStats:
    """Counters of the chunk cache (owned by `ChunkCacheManager`); monotonic
    except the gauges at the end."""

    # Cached segments at admission: resident, new child, joined a child.
    hits: int = 0
    misses: int = 0
    in_flight_joins: int = 0
    # Prompt tokens of resident segments at admission.
    tokens_reused: int = 0
    # Prompt tokens copied (re-positioned) from the pool into requests.
    tokens_loaded: int = 0
    # Child requests started (retries included), the tokens they prefill.
    child_computes: int = 0
    child_tokens: int = 0
    # Children that ended without storing their rows.
    failed_children: int = 0
    # Chunked requests refused after arrival.
    refused_requests: int = 0
    # Chunked requests that had to wait for pool room at least once.
    deferred_requests: int = 0
    # Lookups whose key matched but whose stored tokens did not.
    hash_collisions: int = 0
    evictions: int = 0
    # Gauges: pool blocks, pinned entries, chunked requests + children, and
    # blocks lent to a failed store read's call (in pool_blocks_used too).
    pool_blocks_used: int = 0
    pool_blocks_total: int = 0
    pinned_entries: int = 0
    live_requests: int = 0
    pool_blocks_held: int = 0

    @property
    def lookups(self) -> int:
        return self.hits + self.misses + self.in_flight_joins

    @property
    def hit_rate(self) -> float:
        """Fraction of cached-segment lookups served without a new child."""
        total = self.lookups
        return (self.hits + self.in_flight_joins) / total if total else 0.0

    @property
    def pool_usage(self) -> float:
        total = self.pool_blocks_total
        return self.pool_blocks_used / total if total else 0.0
