# SPDX-License-Identifier: Apache-2.0
"""Scheduler-side logic of the chunk cache (no engine, no tensors).

Life of a chunked request (the parent):

1. `admit`: every cached segment (system + chunks) is keyed and classified
   RESIDENT (in the pool, verified), IN_FLIGHT (a child is computing it) or
   MISSING. The parent pins every entry it will load. Each distinct MISSING
   key gets pool blocks and exactly one child request; a later request
   missing the same key joins that child instead of starting another. If the
   pool cannot hold the missing segments (even after evicting every unpinned
   entry), the parent falls back to a normal prefill: all its pins are
   dropped and the admission says `fallback=True`. Never an error.
2. `child_finished` / `child_failed`: a child stored its rows (the entry
   becomes RESIDENT) or ended without them (its waiters fall back).
3. `is_ready` -> `load_plan`: once every segment is resident, the parent
   gets one SegmentLoad per segment: pool rows -> positions
   [span.start, span.end), with delta = real_start - stored_start.
4. `release` on finish or abort drops the parent's pins; an entry whose
   last pin goes becomes evictable (most recently used).

Children compute `context + segment` where the context follows the
`chunk_context` mode; the system segment (always at position 0) is computed
alone. The manager never blocks or waits: the engine glue polls it.
"""

from dataclasses import dataclass, field

from vllm.v1.core.chunk_block_pool import ChunkBlockPool
from vllm.v1.core.chunk_hash_index import (
    ChunkHashIndex,
    ChunkNamespace,
    compute_chunk_hash,
)
from vllm.v1.core.chunk_structures import (
    ChildSpec,
    ChunkCacheStats,
    ChunkContextMode,
    ChunkedPrompt,
    ChunkHash,
    ChunkLoadPlan,
    ChunkStorePlan,
    SegmentLoad,
    SegmentSpan,
    SegmentStatus,
)

CHILD_REQUEST_PREFIX = "chunkcache-child-"


@dataclass(frozen=True)
class CachedSegment:
    """One cached segment of a parent request, as classified at admission."""

    # Index of the segment in the parent's ChunkedPrompt.
    segment_index: int
    # Where it sits in the parent's prompt.
    span: SegmentSpan
    # Content key.
    chunk_hash: ChunkHash
    # Position its first stored row was computed at (= len(context)).
    stored_start: int
    # Status when the parent was admitted.
    status: SegmentStatus


@dataclass(frozen=True)
class ChunkAdmission:
    """What the engine must do after `ChunkCacheManager.admit`."""

    # The parent request.
    request_id: str
    # True: serve the request as a normal prefill; nothing else applies.
    fallback: bool
    # Cached segments in prompt order (empty on fallback).
    segments: tuple[CachedSegment, ...]
    # Children the engine must schedule now (prefill only, output dropped,
    # prefix-cache reads off).
    new_children: tuple[ChildSpec, ...]

    @property
    def ready(self) -> bool:
        """True if the parent can load everything right away."""
        return not self.fallback and all(
            s.status == SegmentStatus.RESIDENT for s in self.segments
        )


@dataclass
class _ParentState:
    segments: tuple[CachedSegment, ...]
    # Distinct keys this parent holds a pin on, in prompt order (released
    # in that order, so earlier segments become older in the LRU).
    pinned: list[ChunkHash]
    # Distinct keys whose child has not finished yet.
    waiting_on: set[ChunkHash]


@dataclass
class _ChildState:
    spec: ChildSpec
    # Segment ids and context ids, inserted into the index on success.
    segment_ids: list[int]
    context_ids: list[int]
    # Parents waiting for this child.
    waiters: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _SegmentKey:
    chunk_hash: ChunkHash
    segment_ids: list[int]
    context_ids: list[int]


class ChunkCacheManager:
    def __init__(
        self,
        num_pool_blocks: int,
        block_size: int,
        context_mode: ChunkContextMode = ChunkContextMode.SINK,
    ):
        self.pool = ChunkBlockPool(num_pool_blocks, block_size)
        self.index = ChunkHashIndex()
        self.context_mode = ChunkContextMode(context_mode)
        self._parents: dict[str, _ParentState] = {}
        self._children: dict[str, _ChildState] = {}
        self._child_by_hash: dict[ChunkHash, str] = {}
        self._num_children_created = 0
        self._stats = ChunkCacheStats()

    # ------------------------------------------------------------ parents

    def admit(
        self, request_id: str, prompt: ChunkedPrompt, namespace: ChunkNamespace
    ) -> ChunkAdmission:
        if request_id in self._parents:
            raise ValueError(f"request {request_id} is already admitted")
        ns_digest = namespace.digest()
        keyed = [
            self._segment_key(prompt, index, ns_digest)
            for index in range(len(prompt.cached_spans))
        ]

        # Classify each distinct key once; pin residents and in-flight
        # entries first so that the allocations below cannot evict them.
        status_of: dict[ChunkHash, SegmentStatus] = {}
        missing: dict[ChunkHash, _SegmentKey] = {}
        for key in keyed:
            h = key.chunk_hash
            if h in status_of:
                continue
            status = self._classify(key)
            if status is None:  # hash collision: cannot cache this layout
                return self._fall_back(request_id, status_of)
            status_of[h] = status
            if status == SegmentStatus.MISSING:
                missing[h] = key
            else:
                self.pool.pin(h)

        blocks_needed = sum(
            self.pool.blocks_needed(len(k.segment_ids)) for k in missing.values()
        )
        if not self.pool.can_allocate(blocks_needed):
            return self._fall_back(request_id, status_of)

        new_children = []
        for h, key in missing.items():
            new_children.append(self._start_child(key))
            self.pool.pin(h)  # the parent's own pin, besides the writer's

        segments = tuple(
            CachedSegment(
                segment_index=index,
                span=prompt.spans[index],
                chunk_hash=key.chunk_hash,
                stored_start=len(key.context_ids),
                status=status_of[key.chunk_hash],
            )
            for index, key in enumerate(keyed)
        )
        waiting_on = {
            h for h, s in status_of.items() if s != SegmentStatus.RESIDENT
        }
        for h in waiting_on:
            self._children[self._child_by_hash[h]].waiters.add(request_id)
        self._parents[request_id] = _ParentState(
            segments=segments, pinned=list(status_of), waiting_on=waiting_on
        )
        self._count_admission(status_of, segments)
        return ChunkAdmission(
            request_id=request_id,
            fallback=False,
            segments=segments,
            new_children=tuple(new_children),
        )

    def is_ready(self, request_id: str) -> bool:
        return not self._require_parent(request_id).waiting_on

    def load_plan(self, request_id: str) -> ChunkLoadPlan:
        parent = self._require_parent(request_id)
        if parent.waiting_on:
            raise ValueError(
                f"request {request_id} still waits for "
                f"{len(parent.waiting_on)} segment(s)"
            )
        loads = []
        for seg in parent.segments:
            entry = self.pool.get(seg.chunk_hash)
            assert entry is not None, "pinned entries are never evicted"
            loads.append(
                SegmentLoad(
                    chunk_hash=seg.chunk_hash,
                    segment_index=seg.segment_index,
                    pool_block_ids=list(entry.block_ids),
                    num_tokens=seg.span.num_tokens,
                    stored_start=seg.stored_start,
                    dst_start=seg.span.start,
                )
            )
        return ChunkLoadPlan(request_id=request_id, segments=tuple(loads))

    def release(self, request_id: str) -> bool:
        """Drop a parent's pins (finish or abort). False if unknown."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        for h in parent.waiting_on:
            # NOTE: absent when called from child_failed for that very child.
            child_id = self._child_by_hash.get(h)
            if child_id is not None:
                self._children[child_id].waiters.discard(request_id)
        for h in parent.pinned:
            self.pool.unpin(h)
        return True

    def pinned_by(self, request_id: str) -> list[ChunkHash]:
        return list(self._require_parent(request_id).pinned)

    # ----------------------------------------------------------- children

    def is_child(self, request_id: str) -> bool:
        return request_id in self._children

    def store_plan(self, child_request_id: str) -> ChunkStorePlan:
        child = self._require_child(child_request_id)
        entry = self.pool.get(child.spec.chunk_hash)
        assert entry is not None, "a child's entry is pinned by its writer"
        return ChunkStorePlan(
            request_id=child_request_id,
            chunk_hash=child.spec.chunk_hash,
            src_start=child.spec.store_start,
            num_tokens=entry.num_tokens,
            pool_block_ids=list(entry.block_ids),
        )

    def child_finished(self, child_request_id: str) -> list[str]:
        """The child's rows are in the pool. Returns parents now ready."""
        child = self._pop_child(child_request_id)
        h = child.spec.chunk_hash
        self.index.insert(h, child.segment_ids, child.context_ids)
        self.pool.unpin(h)  # the writer's pin
        ready = []
        for parent_id in sorted(child.waiters):
            parent = self._parents[parent_id]
            parent.waiting_on.discard(h)
            if not parent.waiting_on:
                ready.append(parent_id)
        return ready

    def child_failed(self, child_request_id: str) -> list[str]:
        """The child ended without storing. Returns parents that fell back.

        NOTE: its waiters cannot be served from the cache any more without
        a new child; falling back to a normal prefill is always correct.
        """
        child = self._pop_child(child_request_id)
        fallen = sorted(child.waiters)
        for parent_id in fallen:
            self.release(parent_id)
            self._stats.fallbacks += 1
        self.pool.unpin(child.spec.chunk_hash)
        self.pool.free(child.spec.chunk_hash)
        self._stats.failed_children += 1
        return fallen

    # -------------------------------------------------------------- stats

    def stats(self) -> ChunkCacheStats:
        usage = self.pool.usage()
        s = self._stats
        return ChunkCacheStats(
            hits=s.hits,
            misses=s.misses,
            in_flight_joins=s.in_flight_joins,
            tokens_reused=s.tokens_reused,
            fallbacks=s.fallbacks,
            hash_collisions=self.index.num_collisions + s.hash_collisions,
            failed_children=s.failed_children,
            evictions=usage.num_evictions,
            pool_blocks_used=usage.blocks_used,
            pool_blocks_total=usage.blocks_total,
        )

    # ----------------------------------------------------------- internal

    def _segment_key(
        self, prompt: ChunkedPrompt, index: int, ns_digest: bytes
    ) -> _SegmentKey:
        segment_ids = prompt.segment_tokens(index)
        if index == 0 or self.context_mode == ChunkContextMode.NONE:
            # NOTE: the system segment is always at position 0 and sees
            # nothing before it, so it is computed alone in every mode.
            context_ids: list[int] = []
        elif self.context_mode == ChunkContextMode.SINK:
            context_ids = prompt.token_ids[:1]
        else:
            context_ids = prompt.segment_tokens(0)
        return _SegmentKey(
            chunk_hash=compute_chunk_hash(segment_ids, context_ids, ns_digest),
            segment_ids=segment_ids,
            context_ids=context_ids,
        )

    def _classify(self, key: _SegmentKey) -> SegmentStatus | None:
        """Status of a key; None on a hash collision (ids differ)."""
        h = key.chunk_hash
        child_id = self._child_by_hash.get(h)
        if child_id is not None:
            child = self._children[child_id]
            if (child.segment_ids, child.context_ids) != (
                key.segment_ids,
                key.context_ids,
            ):
                self._stats.hash_collisions += 1
                return None
            return SegmentStatus.IN_FLIGHT
        if h in self.index:
            if self.index.lookup(h, key.segment_ids, key.context_ids) is None:
                return None
            return SegmentStatus.RESIDENT
        return SegmentStatus.MISSING

    def _fall_back(
        self, request_id: str, status_of: dict[ChunkHash, SegmentStatus]
    ) -> ChunkAdmission:
        for h, status in status_of.items():
            if status != SegmentStatus.MISSING:
                self.pool.unpin(h)
        self._stats.fallbacks += 1
        return ChunkAdmission(
            request_id=request_id, fallback=True, segments=(), new_children=()
        )

    def _start_child(self, key: _SegmentKey) -> ChildSpec:
        h = key.chunk_hash
        allocation = self.pool.allocate(h, len(key.segment_ids))
        for victim in allocation.evicted:
            self.index.remove(victim)
        child_id = f"{CHILD_REQUEST_PREFIX}{self._num_children_created}-{h.hex()[:16]}"
        self._num_children_created += 1
        spec = ChildSpec(
            request_id=child_id,
            chunk_hash=h,
            token_ids=key.context_ids + key.segment_ids,
            store_start=len(key.context_ids),
        )
        self._children[child_id] = _ChildState(
            spec=spec, segment_ids=key.segment_ids, context_ids=key.context_ids
        )
        self._child_by_hash[h] = child_id
        return spec

    def _count_admission(
        self,
        status_of: dict[ChunkHash, SegmentStatus],
        segments: tuple[CachedSegment, ...],
    ) -> None:
        for status in status_of.values():
            if status == SegmentStatus.RESIDENT:
                self._stats.hits += 1
            elif status == SegmentStatus.IN_FLIGHT:
                self._stats.in_flight_joins += 1
            else:
                self._stats.misses += 1
        self._stats.tokens_reused += sum(
            s.span.num_tokens
            for s in segments
            if s.status == SegmentStatus.RESIDENT
        )

    def _pop_child(self, child_request_id: str) -> _ChildState:
        child = self._require_child(child_request_id)
        del self._children[child_request_id]
        del self._child_by_hash[child.spec.chunk_hash]
        return child

    def _require_parent(self, request_id: str) -> _ParentState:
        parent = self._parents.get(request_id)
        if parent is None:
            raise KeyError(f"request {request_id} is not a chunk-cache parent")
        return parent

    def _require_child(self, request_id: str) -> _ChildState:
        child = self._children.get(request_id)
        if child is None:
            raise KeyError(f"request {request_id} is not a chunk-cache child")
        return child
