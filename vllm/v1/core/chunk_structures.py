# SPDX-License-Identifier: Apache-2.0
"""Typed identities and plain data shared by the chunk-cache modules.

Everything that crosses a module boundary of the chunk cache (parser ->
manager -> connector -> worker) is one of the types below, so that no
module has to know another's internals and no tuple soup travels around.
This module imports nothing from vLLM: it is engine-free by design.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, NewType

if TYPE_CHECKING:
    from vllm.v1.core.chunk_hash_index import ChunkNamespace

# A 16-byte xxh3-128 digest of a segment's content, its private context and
# the namespace it was computed in. Never includes a position (see
# chunk_hash_index.py for the exact composition).
ChunkHash = NewType("ChunkHash", bytes)

# Index of a block of the chunk pool (not of vLLM's paged KV cache).
PoolBlockId = NewType("PoolBlockId", int)


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
    """A prompt split into segments: system, chunks..., question.

    `token_ids` is the final token sequence the model sees (separators
    removed). `spans` partitions it: spans[0] is the system segment (always
    at position 0), spans[1:-1] are the chunks (documents), spans[-1] is the
    question. Every segment but the question is cached by content.
    """

    # The final prompt token ids, separators already removed.
    token_ids: list[int]
    # Contiguous, non-empty spans covering token_ids exactly; at least two
    # (system + question).
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
        cls, token_ids: list[int], lengths: "Sequence[int]"
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
    """One cached segment's rows in the chunk pool.

    Row i of the entry (0 <= i < num_tokens) lives in pool block
    block_ids[i // block_size] at offset i % block_size.
    """

    # Content key of the segment.
    chunk_hash: ChunkHash
    # Pool blocks holding the rows, in row order.
    block_ids: list[PoolBlockId]
    # Number of valid rows (tokens) stored.
    num_tokens: int
    # Number of holders (writer child, loading requests); while > 0 the
    # entry can never be evicted.
    pin_count: int = 0


class AdmitReason(str, Enum):
    """Outcome of `ChunkCacheManager.admit` for a chunked request."""

    # Pins taken, missing segments handed to children: the request will be
    # served from the pool once every segment is resident.
    ADMITTED = "admitted"
    # Not now: the pool is pinned full by requests in flight, or a request
    # that arrived earlier still waits (arrival order, no starvation).
    DEFERRED = "deferred"
    # Its distinct segments need more blocks than the whole pool has: it can
    # never be served exactly, so it is refused.
    OVERSIZED = "oversized"
    # A key matched different tokens: refused rather than served otherwise.
    COLLISION = "collision"
    # A child computing one of its segments failed twice: refused.
    CHILD_FAILED = "child_failed"

    @property
    def refused(self) -> bool:
        return self not in (AdmitReason.ADMITTED, AdmitReason.DEFERRED)


@dataclass(frozen=True)
class ChunkRefusal:
    """A chunked request the engine must finish with an error."""

    # The (parent) request.
    request_id: str
    # Why it cannot be served under the chunk-isolation semantics.
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

    # Request id of the child (unique among live requests).
    request_id: str
    # Key of the segment the child computes.
    chunk_hash: ChunkHash
    # Tokens the child prefills: private context + segment.
    token_ids: list[int]
    # Index in token_ids of the first row to store (= len(context)); rows
    # [store_start, len(token_ids)) go to the pool.
    store_start: int
    # Its entry's pool blocks, in row order (fixed for the child's life).
    pool_block_ids: tuple[PoolBlockId, ...] = ()
    # The namespace its key was made in (the tenant its store entry is
    # written under: cache salt, LoRA adapter).
    namespace: "ChunkNamespace | None" = None
    # What the engine glue needs to build the child's request, from the
    # parent whose admission started it (opaque here: client, priority,
    # LoRA request...), so that no parent request is kept for it.
    origin: Any = None


@dataclass(frozen=True)
class SegmentLoad:
    """One cached segment to copy from the pool into a request's KV."""

    # Key of the entry.
    chunk_hash: ChunkHash
    # Index of the segment in the request's ChunkedPrompt.
    segment_index: int
    # Pool blocks holding the rows, in row order.
    pool_block_ids: list[PoolBlockId]
    # Number of rows to copy.
    num_tokens: int
    # Position the first row was computed at in the child (0 or len(ctx)).
    stored_start: int
    # Position of the first row in the request (its span start).
    dst_start: int
    # First row to copy: rows before it are already in the request's paged
    # KV (vLLM's own prefix cache hit on an identical chunked request, or an
    # earlier stretch of a boundary-recompute request).
    first_row: int = 0
    # One past the last row to copy (None: num_tokens); rows after it are
    # loaded by a later stretch, or recomputed in the request.
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
    """Worker instruction: fill a request's KV prefix from the chunk pool."""

    # The (parent) request that receives the rows.
    request_id: str
    # Segment copies in prompt order (their rows [first_row, row_end)).
    segments: tuple[SegmentLoad, ...]

    @property
    def num_rows_to_copy(self) -> int:
        return sum(s.row_end - s.first_row for s in self.segments)


@dataclass
class ChunkCacheStats:
    """Counters of the chunk cache; monotonic except the gauges at the end.

    Every field is owned by `ChunkCacheManager`; nobody else corrects them.
    """

    # Cached segments found resident at admission.
    hits: int = 0
    # Cached segments that needed a new child request.
    misses: int = 0
    # Cached segments that joined a child already in flight (dedup).
    in_flight_joins: int = 0
    # Prompt tokens of resident segments at admission.
    tokens_reused: int = 0
    # Prompt tokens copied (re-positioned) from the pool into requests.
    tokens_loaded: int = 0
    # Child requests started (first attempts and retries).
    child_computes: int = 0
    # Tokens prefilled by child requests (context included).
    child_tokens: int = 0
    # Children that ended without storing their rows.
    failed_children: int = 0
    # Chunked requests refused after arrival (oversized, collision, failed
    # children); never served with another attention.
    refused_requests: int = 0
    # Chunked requests that had to wait for pool room at least once.
    deferred_requests: int = 0
    # Lookups whose key matched but whose stored tokens did not.
    hash_collisions: int = 0
    # Entries evicted from the pool (LRU).
    evictions: int = 0
    # Gauges at the time of the snapshot: pool blocks, pinned entries and
    # chunked requests + children the manager still tracks.
    pool_blocks_used: int = 0
    pool_blocks_total: int = 0
    pinned_entries: int = 0
    live_requests: int = 0
    # Pool blocks a failed store read's rows are still lent to the store's
    # call (in no entry until every rank reported them back; counted in
    # pool_blocks_used too).
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
