# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scheduler-side logic of the chunk cache (no engine, no tensors, never
blocks). The manager owns every chunked request's state and every counter
(docs/design/ownership.md, "Life of a request"):

* `add_request` queues a parent; nothing is pinned until it is admitted.
* `decide` admits in arrival order and answers one `StepDecision` per parent
  and step. Each cached segment is RESIDENT, IN_FLIGHT (a child computes it)
  or MISSING; the pool reserves every pin and new entry in one step or not
  at all; each MISSING key gets one child computing `context + segment`, or
  with a store one fetch (docs/design/store-path.md). A request that can
  never fit the pool, or whose key matched other tokens, is refused.
* `finish_child` and `store_report` settle a child's or fetch's end; a
  failed child is retried once, then its waiters are refused.
* `release` drops a parent's pins; `reset` starts a new epoch, part of
  every key, so nothing computed before it is found again.
"""

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from vllm.v1.core.chunk_block_pool import ChunkBlockPool, Residence
from vllm.v1.core.chunk_hash_index import (
    TOKEN_ID_BYTES,
    chunk_hash_of_bytes,
    token_bytes,
)
from vllm.v1.core.chunk_prefill_plan import PrefillPlan
from vllm.v1.core.chunk_step_decision import ChildPut, Outcome, StepDecision
from vllm.v1.core.chunk_store_probe import (
    FETCH_ID_PREFIX,
    FetchSpec,
    ReportResult,
    StoreAnswer,
    StoreProbe,
)
from vllm.v1.core.chunk_structures import (
    AdmitReason,
    ChildSpec,
    ChunkCacheStats,
    ChunkContextMode,
    ChunkedPrompt,
    ChunkHash,
    ChunkLoadPlan,
    ChunkNamespace,
    ChunkRefusal,
    PoolBlockId,
    SegmentLoad,
    SegmentSpan,
    SegmentStatus,
)

CHILD_REQUEST_PREFIX = "chunkcache-child-"
# A child that ends without its rows is started once more before its
# waiters are refused (e.g. it was aborted by an engine-wide reset).
MAX_CHILD_ATTEMPTS = 2
POOL_FLAGS = "--chunk-pool-fraction or --chunk-pool-size-gib"
# A segment's status by what the pool knows of it (a collision has none).
_STATUS_OF = {
    Residence.RESIDENT: SegmentStatus.RESIDENT,
    Residence.ABSENT: SegmentStatus.MISSING,
}


@dataclass(frozen=True)
class CachedSegment:
    """One cached segment of a parent request, as classified at admission."""

    segment_index: int
    span: SegmentSpan
    chunk_hash: ChunkHash
    # Position its first stored row was computed at (= len(context)).
    stored_start: int
    status: SegmentStatus


@dataclass(frozen=True)
class ChunkAdmission:
    """What `ChunkCacheManager.admit` decided."""

    request_id: str
    reason: AdmitReason
    # Cached segments in prompt order (empty unless admitted).
    segments: tuple[CachedSegment, ...] = ()
    # For refusals: what the client is told.
    message: str = ""
    # The children and fetches it started (handed out once, by its decision).
    children: tuple[ChildSpec, ...] = ()
    fetches: tuple[FetchSpec, ...] = ()


@dataclass
class _Parent:
    prompt: ChunkedPrompt
    namespace: ChunkNamespace
    plan: PrefillPlan
    # None until admitted; a refusal is final.
    reason: AdmitReason | None = None
    segments: tuple[CachedSegment, ...] = ()
    # Distinct keys it pins, in prompt order (released in that order, so
    # earlier segments become older in the LRU).
    pinned: list[ChunkHash] = field(default_factory=list)
    # Distinct keys whose child has not finished yet.
    waiting_on: set[ChunkHash] = field(default_factory=set)
    # Counted in `deferred_requests` already.
    was_deferred: bool = False
    # Arrival order (the queue's order, also after a re-admission).
    seq: int = 0
    # The manager's epoch when it was admitted.
    epoch: int = 0
    origin: object = None

    def clear(self, reason: AdmitReason | None) -> None:
        """Holds nothing any more: queued again (None) or refused."""
        self.reason = reason
        self.segments = ()
        self.pinned = []
        self.waiting_on = set()


@dataclass
class _Child:
    spec: ChildSpec
    segment_ids: list[int]
    context_ids: list[int]
    # How many times this key's child has been started.
    attempt: int = 1
    # Parents waiting for it.
    waiters: set[str] = field(default_factory=set)
    # Set for a store fetch.
    fetch: FetchSpec | None = None


@dataclass(frozen=True)
class _SegmentKey:
    chunk_hash: ChunkHash
    segment_ids: list[int]
    context_ids: list[int]
    # The namespace the key was made in (with the epoch).
    namespace: ChunkNamespace
    # The ids as `token_bytes` serialises them (verified by `_classify`);
    # None in a key rebuilt from a child (`_key_of`), never classified.
    tokens: bytes | None = None
    context: bytes | None = None


class ChunkCacheManager:
    def __init__(
        self,
        num_pool_blocks: int,
        block_size: int,
        context_mode: ChunkContextMode = ChunkContextMode.SINK,
        sink_token_id: int | None = None,
        recompute_tokens: int = 0,
        store: StoreProbe | None = None,
        held_limit_s: float | None = None,
    ):
        self.recompute_tokens = recompute_tokens
        self.context_mode = ChunkContextMode(context_mode)
        if self.context_mode == ChunkContextMode.SINK and sink_token_id is None:
            raise ValueError(
                "--chunk-context sink needs a sink token (--chunk-sink-token-id)"
            )
        self.sink_token_id = sink_token_id
        self.pool = ChunkBlockPool(num_pool_blocks, block_size)
        self._parents: dict[str, _Parent] = {}
        # Parents not admitted yet, in arrival order.
        self._queued: OrderedDict[str, None] = OrderedDict()
        self._children: dict[str, _Child] = {}
        # Failed fetches waiting for their lent rows (no room elsewhere).
        self._waiting_for_rows: set[str] = set()
        # Failed fetches whose rows a store call holds -> when they failed;
        # written off past `held_limit_s` (None: held until returned).
        self.held_limit_s = held_limit_s
        self.clock = time.monotonic
        self._held_since: dict[str, float] = {}
        self._child_by_hash: dict[ChunkHash, str] = {}
        self._refusals: list[ChunkRefusal] = []
        self._num_children_created = 0
        self._num_parents_seen = 0
        # Bumped by `reset`; mixed into every key.
        self._epoch = 0
        self.store_probe = store
        # Entries pinned until their put ships (`puts_shipped`).
        self._put_pins: list[ChunkHash] = []
        self._stats = ChunkCacheStats()

    def add_request(
        self,
        request_id: str,
        prompt: ChunkedPrompt,
        namespace: ChunkNamespace,
        origin: object = None,
    ) -> None:
        """A chunked request arrived (nothing is pinned until `admit`);
        `origin` comes back in its children's specs."""
        if request_id in self._parents or request_id in self._children:
            raise ValueError(f"request {request_id} is already known")
        self._parents[request_id] = _Parent(
            prompt=prompt,
            namespace=namespace,
            plan=PrefillPlan.for_prompt(prompt, self.recompute_tokens),
            seq=self._num_parents_seen,
            origin=origin,
        )
        self._num_parents_seen += 1
        self._queued[request_id] = None

    def admit(self, request_id: str) -> ChunkAdmission:
        """Admit a queued parent, now that the scheduler is about to run it.
        Idempotent, except that a parent admitted before a `reset` is
        admitted afresh."""
        parent = self._require_parent(request_id)
        if parent.reason == AdmitReason.ADMITTED and parent.epoch != self._epoch:
            self._requeue(request_id, parent)
        if parent.reason is not None:
            return ChunkAdmission(request_id, parent.reason, parent.segments)
        if next(iter(self._queued)) != request_id:
            return self._defer(request_id, parent)
        prompt = parent.prompt
        # NOTE: the epoch makes keys from before a reset unreachable.
        namespace = dataclasses.replace(parent.namespace, weights_epoch=self._epoch)
        ns_digest = namespace.digest()
        keyed = self._segment_keys(prompt, namespace, ns_digest)
        distinct = {k.chunk_hash: k for k in keyed}
        needed = sum(
            self.pool.blocks_needed(len(k.segment_ids)) for k in distinct.values()
        )
        if needed > self.pool.num_blocks:
            return self._refuse(
                request_id,
                AdmitReason.OVERSIZED,
                oversized_message(needed, self.pool.num_blocks, self.pool.block_size),
            )

        status_of: dict[ChunkHash, SegmentStatus] = {}
        for h, key in distinct.items():
            status = self._classify(key)
            if status is None:
                return self._refuse(
                    request_id,
                    AdmitReason.COLLISION,
                    "chunk cache: a segment's content key matched different tokens "
                    "(hash collision); the request cannot be served exactly",
                )
            status_of[h] = status

        missing = [
            distinct[h] for h, s in status_of.items() if s == SegmentStatus.MISSING
        ]
        store_hits = self._probe_store(missing, namespace)
        if store_hits is None:
            # NOTE: a store query is in flight: wait a step (not counted as
            # deferred; the scheduler never waits on the network).
            return ChunkAdmission(request_id, AdmitReason.DEFERRED)
        # NOTE: existing entries are pinned before the new ones are
        # allocated, so that those allocations cannot evict them.
        reservation = self.pool.reserve(
            [h for h, s in status_of.items() if s != SegmentStatus.MISSING],
            [(k.chunk_hash, len(k.segment_ids)) for k in missing],
        )
        if reservation is None:
            return self._defer(request_id, parent)

        children: list[ChildSpec] = []
        fetches: list[FetchSpec] = []
        for key in missing:
            content_hash = store_hits.get(key.chunk_hash)
            if content_hash is None:
                children.append(self._new_child(key, 1, parent.origin))
            else:
                # NOTE: an in-flight child (same pins, waiters and joins),
                # handed out as a fetch, never as a vLLM request.
                fetch = self._register(
                    FETCH_ID_PREFIX, key, parent.origin, content_hash=content_hash
                ).fetch
                assert fetch is not None
                fetches.append(fetch)
            self.pool.pin(key.chunk_hash)  # the parent's, besides the writer's

        parent.segments = tuple(
            CachedSegment(
                segment_index=index,
                span=prompt.spans[index],
                chunk_hash=key.chunk_hash,
                stored_start=len(key.context_ids),
                status=status_of[key.chunk_hash],
            )
            for index, key in enumerate(keyed)
        )
        parent.pinned = list(status_of)
        parent.waiting_on = {
            h for h, s in status_of.items() if s != SegmentStatus.RESIDENT
        }
        for h in parent.waiting_on:
            self._children[self._child_by_hash[h]].waiters.add(request_id)
        parent.reason = AdmitReason.ADMITTED
        parent.epoch = self._epoch
        del self._queued[request_id]
        self._count_admission(status_of, parent.segments)
        return ChunkAdmission(
            request_id,
            AdmitReason.ADMITTED,
            parent.segments,
            children=tuple(children),
            fetches=tuple(fetches),
        )

    def decide(self, request_id: str, admit: bool = True) -> StepDecision | None:
        """The parent's decision for this step (None: unknown): admitted now
        if it can be, the children and fetches that started, and once ready
        every cached segment's rows with the pool blocks it pins (stable:
        a pinned entry is never evicted or moved). `admit=False` for a
        running parent: it keeps its admission, also one from before a
        reset, as vLLM's running requests keep their KV; nothing starts."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        admission = (
            self.admit(request_id)
            if admit
            else ChunkAdmission(request_id, parent.reason or AdmitReason.DEFERRED)
        )
        ready = parent.reason == AdmitReason.ADMITTED and not parent.waiting_on
        segments: tuple[SegmentLoad, ...] = ()
        if ready:
            segments = tuple(
                SegmentLoad(
                    chunk_hash=seg.chunk_hash,
                    segment_index=seg.segment_index,
                    pool_block_ids=self._pool_block_list(seg.chunk_hash),
                    num_tokens=seg.span.num_tokens,
                    stored_start=seg.stored_start,
                    dst_start=seg.span.start,
                )
                for seg in parent.segments
            )
        return StepDecision(
            request_id,
            admission.reason,
            ready,
            parent.plan,
            segments,
            admission.children,
            admission.fetches,
        )

    def record_load(self, plan: ChunkLoadPlan) -> None:
        """Count a plan whose rows were sent to the workers (`load_plan` is a
        query: a plan dropped or asked twice loads nothing)."""
        self._stats.tokens_loaded += plan.num_rows_to_copy

    def release(self, request_id: str) -> bool:
        """Forget a parent (finish or abort, any state). False if unknown."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        self._queued.pop(request_id, None)
        self.pool.unpin_all(self._let_go(request_id, parent))
        return True

    def reset(self) -> bool:
        """Forget every cached segment (new weights, or a sleep discarded the
        pool): unpinned entries are freed now, pinned ones retired (freed on
        their last unpin, never found again). True if nothing was pinned, as
        vLLM's prefix cache answers a reset while blocks are in use."""
        usage = self.pool.usage()
        self._epoch += 1
        self.pool.retire_all()
        return usage.num_entries == usage.num_evictable

    def take_refusals(self) -> list[ChunkRefusal]:
        """Parents refused since the last call, for the engine to finish with
        an error (they stay known until `release`)."""
        refusals, self._refusals = self._refusals, []
        return refusals

    def finish_child(
        self, child_request_id: str, stored: bool, ended: str = ""
    ) -> Outcome:
        """A child ended, its rows stored or not (`ended`: how): the parents
        now ready, its retry, and with a store its entry to write, unless a
        reset retired it."""
        child = self._pop_child(child_request_id)
        if not stored:
            return self._child_failed(child, ended)
        return self._child_finished(child, put=self.store_probe is not None)

    def puts_shipped(self) -> None:
        """The step's metadata now carries every put handed out since the last
        call: their pins drop (why pinned until now, and not longer:
        docs/design/store-path.md, "Puts")."""
        for chunk_hash in self._put_pins:
            self.pool.unpin(chunk_hash)
        self._put_pins = []

    def store_report(self, result: ReportResult) -> Outcome:
        """The store's decisions from a step's report: fetches done, failed
        (computed by a child), rows returned. NOTE: returned rows first: the
        blocks they free may be the room a failed fetch needs."""
        started = [self._rows_returned(fetch_id) for fetch_id in result.rows_returned]
        ready: list[str] = []
        for fetch_id in result.done:
            fetch = self._pop_child(fetch_id)
            assert fetch.fetch is not None
            # NOTE: ends as a child that stored its rows (no put: the store
            # has it).
            ready += self._child_finished(fetch, put=False).ready
        started += [
            self._fetch_failed(f.fetch_id, rows_lent=f.rows_held) for f in result.failed
        ]
        return Outcome(
            children=tuple(c for c in started if c is not None), ready=tuple(ready)
        )

    def write_off_held(self) -> Outcome:
        """Once per scheduler step (a call that never returns sends no
        report): failed fetches whose rows a store call has held for
        `held_limit_s` are written off (`Outcome.written_off`: the store
        forgets them), with the children that compute a waiting one."""
        limit = self.held_limit_s
        if limit is None or not self._held_since:
            return Outcome()
        now = self.clock()
        expired = [f for f, since in self._held_since.items() if now - since >= limit]
        started = [self._rows_written_off(fetch_id) for fetch_id in expired]
        return Outcome(
            children=tuple(c for c in started if c is not None),
            written_off=tuple(expired),
        )

    def _child_finished(self, child: _Child, put: bool) -> Outcome:
        """The child's rows are in the pool: the parents now ready and, with
        `put`, the entry to write to the store."""
        h = child.spec.chunk_hash
        ready = []
        for parent_id in sorted(child.waiters):
            parent = self._parents[parent_id]
            parent.waiting_on.discard(h)
            if not parent.waiting_on:
                ready.append(parent_id)
        # NOTE: with a put, the writer's pin becomes the put's until its step
        # ships (`puts_shipped`); a retired entry is neither published nor put.
        published = self.pool.publish(
            h, child.segment_ids, child.context_ids, keep_pin=put
        )
        if not (published and put):
            return Outcome(ready=tuple(ready))
        self._put_pins.append(h)
        spec = child.spec
        assert spec.namespace is not None
        return Outcome(
            ready=tuple(ready),
            put=ChildPut(
                tuple(spec.token_ids),
                spec.store_start,
                spec.namespace.cache_salt,
                spec.namespace.lora_name,
                spec.pool_block_ids,
                self._epoch,
            ),
        )

    def _child_failed(self, child: _Child, ended: str) -> Outcome:
        """The child ended without storing (`ended`: how): its retry, with
        the entry's blocks and pins, or after the last attempt none, its
        waiters refused."""
        self._stats.failed_children += 1
        if child.attempt < MAX_CHILD_ATTEMPTS:
            key, attempt = self._key_of(child), child.attempt + 1
            retry = self._new_child(key, attempt, child.spec.origin, child.waiters)
            return Outcome(children=(retry,))
        h = child.spec.chunk_hash
        how = f", the last ended {ended}" if ended else ""
        unpins = self._refuse_waiters(
            child,
            f"({len(child.segment_ids)} tokens, chunk key {h.hex()[:16]}) could "
            f"not be computed ({MAX_CHILD_ATTEMPTS} attempts{how}); the request is "
            "refused rather than served with another attention",
        )
        # NOTE: the entry's own pins (waiters', writer's) drop last, with it.
        self.pool.unpin_all(unpins + [h] * (len(child.waiters) + 1), free=h)
        return Outcome()

    @property
    def epoch(self) -> int:
        return self._epoch

    def _fetch_failed(
        self, fetch_id: str, *, rows_lent: bool = False
    ) -> ChildSpec | None:
        """A worker's read failed: the entry is computed by a child instead,
        with the same pins. `rows_lent`: a store call may still write into
        the fetch's rows, so the child computes into new blocks (the old ones
        held until `_rows_returned`), or with no room for them the fetch
        waits in flight (None) and computes in its own once they return."""
        fetch = self._require_child(fetch_id)
        assert fetch.fetch is not None
        if rows_lent:
            if self.held_limit_s is not None:
                self._held_since[fetch_id] = self.clock()
            if self.pool.relocate(fetch.spec.chunk_hash, holder=fetch_id) is None:
                # NOTE: waiting costs the rest of the store's call; refusing
                # would fail requests a full pool could still serve exactly.
                self._waiting_for_rows.add(fetch_id)
                return None
        return self._compute_failed_fetch(fetch_id)

    def _rows_returned(self, fetch_id: str) -> ChildSpec | None:
        """Every store call holding a failed fetch's rows returned: its former
        blocks are free again, or a fetch that waited for them is computed
        there. KeyError for a fetch whose rows were not held."""
        self._held_since.pop(fetch_id, None)
        if fetch_id in self._waiting_for_rows:
            self._waiting_for_rows.discard(fetch_id)
            return self._compute_failed_fetch(fetch_id)
        self.pool.release_held(fetch_id)
        return None

    def _rows_written_off(self, fetch_id: str) -> ChildSpec | None:
        """A failed fetch's rows were held past `held_limit_s` (the call may
        never return): its blocks leave the pool for good, and a fetch that
        waited for them is computed in new blocks if the pool has room, else
        its waiters are refused. KeyError for a fetch whose rows were not held."""
        self._held_since.pop(fetch_id, None)
        if fetch_id not in self._waiting_for_rows:
            self.pool.write_off(fetch_id)
            return None
        self._waiting_for_rows.discard(fetch_id)
        h = self._require_child(fetch_id).spec.chunk_hash
        if self.pool.relocate(h, holder=fetch_id) is not None:
            self.pool.write_off(fetch_id)
            return self._compute_failed_fetch(fetch_id)
        num_blocks = len(self._pool_block_list(h))
        fetch = self._pop_child(fetch_id)
        self.pool.unpin_all(
            self._refuse_waiters(
                fetch,
                "was being read from the chunk store (--chunk-store), whose call "
                "never returned the pool rows it was given; those "
                f"{num_blocks} pool block(s) are written off, and the pool has no "
                "other room to compute it now, so the request is refused rather "
                f"than kept waiting (enlarge the pool: {POOL_FLAGS})",
            )
        )
        self.pool.detach(h, holder=fetch_id)
        self.pool.write_off(fetch_id)
        return None

    def _compute_failed_fetch(self, fetch_id: str) -> ChildSpec:
        fetch = self._pop_child(fetch_id)
        return self._new_child(self._key_of(fetch), 1, fetch.spec.origin, fetch.waiters)

    def _probe_store(
        self, missing: list[_SegmentKey], namespace: ChunkNamespace
    ) -> dict[ChunkHash, int] | None:
        """Store hits among `missing` (key -> content hash); None while a query
        has not answered."""
        if self.store_probe is None or not missing:
            return {}
        hits: dict[ChunkHash, int] = {}
        pending = False
        for key in missing:
            found = self.store_probe.lookup(key.segment_ids, key.context_ids, namespace)
            if found.answer == StoreAnswer.PENDING:
                pending = True
            elif found.answer == StoreAnswer.HIT:
                hits[key.chunk_hash] = found.content_hash
        return None if pending else hits

    def stats(self) -> ChunkCacheStats:
        usage = self.pool.usage()
        return dataclasses.replace(
            self._stats,
            evictions=usage.num_evictions,
            pool_blocks_used=usage.blocks_used,
            pool_blocks_total=usage.blocks_total,
            pinned_entries=usage.num_entries - usage.num_evictable,
            live_requests=len(self._parents) + len(self._children),
            # NOTE: a fetch waiting for its lent rows holds its own blocks.
            pool_blocks_held=usage.blocks_held
            + sum(
                len(self._pool_block_list(self._children[f].spec.chunk_hash))
                for f in self._waiting_for_rows
            ),
        )

    def _segment_keys(
        self,
        prompt: ChunkedPrompt,
        namespace: ChunkNamespace,
        ns_digest: bytes,
    ) -> list[_SegmentKey]:
        """Every cached segment's key, each hashing its slice of the prompt's
        ids serialised once (`_classify` verifies the same slice)."""
        spans = prompt.cached_spans
        data = token_bytes(prompt.token_ids[: spans[-1].end])
        keys = []
        context_ids: list[int] | None = None
        context = b""
        for index, span in enumerate(spans):
            segment_ids = prompt.segment_tokens(index)
            ids = segment_context(prompt, index, self.context_mode, self.sink_token_id)
            if ids != context_ids:  # serialised anew whenever it changes
                context_ids, context = ids, token_bytes(ids)
            tokens = data[TOKEN_ID_BYTES * span.start : TOKEN_ID_BYTES * span.end]
            keys.append(
                _SegmentKey(
                    chunk_hash=chunk_hash_of_bytes(tokens, context, ns_digest),
                    segment_ids=segment_ids,
                    context_ids=ids,
                    namespace=namespace,
                    tokens=tokens,
                    context=context,
                )
            )
        return keys

    def _classify(self, key: _SegmentKey) -> SegmentStatus | None:
        """Status of a key; None on a hash collision."""
        child_id = self._child_by_hash.get(key.chunk_hash)
        status: SegmentStatus | None
        if child_id is not None:
            child = self._children[child_id]
            same = (child.segment_ids, child.context_ids) == (
                key.segment_ids,
                key.context_ids,
            )
            status = SegmentStatus.IN_FLIGHT if same else None
        else:
            assert key.tokens is not None and key.context is not None
            found = self.pool.find_bytes(key.chunk_hash, key.tokens, key.context)
            status = _STATUS_OF.get(found)
        if status is None:
            self._stats.hash_collisions += 1
        return status

    def _let_go(
        self, request_id: str, parent: _Parent, skip: ChunkHash | None = None
    ) -> list[ChunkHash]:
        """The parent stops waiting for its children; returns its pins to
        drop, in prompt order (except on `skip`)."""
        for h in parent.waiting_on - {skip}:
            child_id = self._child_by_hash.get(h)
            if child_id is not None:  # None: the child itself just ended
                self._children[child_id].waiters.discard(request_id)
        return [h for h in parent.pinned if h != skip]

    def _requeue(self, request_id: str, parent: _Parent) -> None:
        """Undo an admission from an older epoch: back to the queue at its
        arrival place."""
        self.pool.unpin_all(self._let_go(request_id, parent))
        parent.clear(None)
        self._queued[request_id] = None
        order = sorted(self._queued, key=lambda rid: self._parents[rid].seq)
        self._queued = OrderedDict.fromkeys(order)

    def _defer(self, request_id: str, parent: _Parent) -> ChunkAdmission:
        if not parent.was_deferred:
            parent.was_deferred = True
            self._stats.deferred_requests += 1
        return ChunkAdmission(request_id, AdmitReason.DEFERRED)

    def _refuse(
        self, request_id: str, reason: AdmitReason, message: str
    ) -> ChunkAdmission:
        self._parents[request_id].clear(reason)
        self._queued.pop(request_id, None)
        self._refusals.append(ChunkRefusal(request_id, reason, message))
        self._stats.refused_requests += 1
        return ChunkAdmission(request_id, reason, message=message)

    def _refuse_waiters(self, child: _Child, what: str) -> list[ChunkHash]:
        """Refuse every parent waiting for `child`, telling which segment
        `what` happened to; returns their pins to drop, except on the child's
        own entry (the caller drops those with the entry)."""
        h = child.spec.chunk_hash
        unpins: list[ChunkHash] = []
        for parent_id in sorted(child.waiters):
            parent = self._parents[parent_id]
            where = (
                ", ".join(
                    "the system segment"
                    if s.segment_index == 0
                    else f"document {s.segment_index}"
                    for s in parent.segments
                    if s.chunk_hash == h
                )
                or "a segment"
            )
            unpins += self._let_go(parent_id, parent, skip=h)
            self._refuse(
                parent_id,
                AdmitReason.CHILD_FAILED,
                f"chunk cache: {where} of this request {what}. Nothing of it "
                "was cached: retrying the request is safe.",
            )
        return unpins

    def _internal_id(self, prefix: str, h: ChunkHash) -> str:
        # NOTE: one counter for children and fetches: no two share an id.
        rid = f"{prefix}{self._num_children_created}-{h.hex()[:16]}"
        self._num_children_created += 1
        return rid

    def _new_child(
        self,
        key: _SegmentKey,
        attempt: int,
        origin: object,
        waiters: set[str] | None = None,
    ) -> ChildSpec:
        spec = self._register(CHILD_REQUEST_PREFIX, key, origin, attempt, waiters).spec
        self._stats.child_computes += 1
        self._stats.child_tokens += len(spec.token_ids)
        return spec

    def _register(
        self,
        prefix: str,
        key: _SegmentKey,
        origin: object,
        attempt: int = 1,
        waiters: set[str] | None = None,
        content_hash: int | None = None,
    ) -> _Child:
        """A new in-flight writer of `key`'s entry (with `content_hash`, a
        store fetch)."""
        h = key.chunk_hash
        spec = ChildSpec(
            request_id=self._internal_id(prefix, h),
            chunk_hash=h,
            token_ids=key.context_ids + key.segment_ids,
            store_start=len(key.context_ids),
            pool_block_ids=tuple(self._pool_block_list(h)),
            namespace=key.namespace,
            origin=origin,
        )
        fetch = (
            None
            if content_hash is None
            else FetchSpec(
                spec.request_id,
                h,
                spec.token_ids,
                spec.store_start,
                content_hash,
                self._epoch,
                spec.pool_block_ids,
            )
        )
        child = self._children[spec.request_id] = _Child(
            spec=spec,
            segment_ids=key.segment_ids,
            context_ids=key.context_ids,
            attempt=attempt,
            waiters=set() if waiters is None else waiters,
            fetch=fetch,
        )
        self._child_by_hash[h] = spec.request_id
        return child

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
            s.span.num_tokens for s in segments if s.status == SegmentStatus.RESIDENT
        )

    def _pool_block_list(self, h: ChunkHash) -> list[PoolBlockId]:
        entry = self.pool.get(h)
        assert entry is not None, "a pinned entry is never evicted"
        return list(entry.block_ids)

    @staticmethod
    def _key_of(child: _Child) -> _SegmentKey:
        assert child.spec.namespace is not None
        return _SegmentKey(
            child.spec.chunk_hash,
            child.segment_ids,
            child.context_ids,
            child.spec.namespace,
        )

    def _pop_child(self, child_request_id: str) -> _Child:
        child = self._require_child(child_request_id)
        del self._children[child_request_id]
        del self._child_by_hash[child.spec.chunk_hash]
        return child

    def _require_parent(self, request_id: str) -> _Parent:
        parent = self._parents.get(request_id)
        if parent is None:
            raise KeyError(f"request {request_id} is not a chunk-cache parent")
        return parent

    def _require_child(self, request_id: str) -> _Child:
        child = self._children.get(request_id)
        if child is None:
            raise KeyError(f"request {request_id} is not a chunk-cache child")
        return child


def segment_context(
    prompt: ChunkedPrompt, index: int, mode: ChunkContextMode, sink_token_id: int | None
) -> list[int]:
    """What segment `index` is computed after (part of its key). The system
    segment, at position 0, sees nothing before it in every mode; the sink
    is a constant of the deployment, so a key never depends on the system
    prompt."""
    if index == 0 or mode == ChunkContextMode.NONE:
        return []
    if mode == ChunkContextMode.SINK:
        assert sink_token_id is not None
        return [sink_token_id]
    return prompt.segment_tokens(0)


def pool_blocks_for(
    prompt: ChunkedPrompt, block_size: int, context_mode: ChunkContextMode
) -> int:
    """Pool blocks the prompt's distinct cached segments need, as admission
    counts them (for the front end's 400). NOTE: any sink stands for the
    deployment's here: one constant for every chunk keeps the same keys
    distinct."""
    mode = ChunkContextMode(context_mode)
    distinct = {
        (
            tuple(segment_context(prompt, index, mode, 0)),
            tuple(prompt.segment_tokens(index)),
        )
        for index in range(len(prompt.cached_spans))
    }
    return sum(-(-len(tokens) // block_size) for _, tokens in distinct)


def oversized_message(needed: int, pool_blocks: int, block_size: int) -> str:
    return (
        f"chunk cache: the cached segments of this prompt need {needed} chunk pool "
        f"blocks ({needed * block_size} rows), but the chunk pool has "
        f"{pool_blocks} blocks in total; send fewer or shorter documents, or "
        f"enlarge the pool ({POOL_FLAGS})"
    )
