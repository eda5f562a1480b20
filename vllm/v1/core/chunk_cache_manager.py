# SPDX-License-Identifier: Apache-2.0
"""Scheduler-side logic of the chunk cache (no engine, no tensors).

The manager is the one owner of every chunked request's state and of every
counter (docs/design/ownership.md). Life of a chunked request (the parent):

1. `add_request` on arrival: the parent is queued. Nothing is pinned yet,
   so a request waiting in vLLM's queue holds no pool room.
2. `decide` (which admits) when the scheduler is about to run it: one
   frozen `StepDecision` per step (chunk_step_decision.py) that every
   scheduler hook of the step reads. Parents are admitted in
   arrival order: while an earlier parent waits for room, later ones are
   DEFERRED too (a big request is never starved by a stream of small ones).
   Every cached segment (system + chunks) is keyed and classified RESIDENT
   (in the pool, verified), IN_FLIGHT (a child computes it) or MISSING. The
   pool reserves, in one step or not at all, a pin on every entry the parent
   will load and pool blocks for each distinct MISSING key, which gets
   exactly one child request (`StepDecision.children`). A request
   whose segments can never fit the pool is refused (OVERSIZED), as is one
   whose key matched other tokens (COLLISION): never served otherwise.
   With a fleet-wide store (the `store` constructor argument, issue 31) a
   MISSING key the store holds is fetched instead (`StepDecision.fetches`:
   pinned like a child; `store_report` ends it, a failed one becoming a
   child); a query not answered yet makes the parent wait a step
   (docs/design/store-path.md).
   A failed fetch whose rows a store call still holds is computed into new
   blocks (the old ones held until `rows_returned`), or, with no room for
   them, in its own once they are returned; rows held past `held_limit_s`
   are written off by `write_off_held`, once per scheduler step.
3. `finish_child` (one `Outcome`): a child stored its
   rows (the entry becomes RESIDENT; with a store, the `Outcome` carries its
   put) or ended without them; a failed child is retried once, then its
   waiters are refused (`take_refusals`).
4. Once every segment is resident the decision is ready: its plan says
   which stretch to load at a position (all of system and chunks at once,
   or with boundary recompute the part of each chunk after its first K
   tokens, chunk_prefill_plan.py) and `StepDecision.load_plan` the rows to
   copy, with delta = real_start - stored_start.
5. `release` on finish or abort, in any state, drops the parent's pins.
6. `reset` (vLLM resets its caches: new weights, sleep, pause with
   clear_cache) retires every entry and starts a new epoch, which is part
   of every key: nothing computed before it is found again. A parent
   admitted in an older epoch is admitted afresh when the scheduler next
   asks for it (a waiting or preempted request); one that is running keeps
   the rows it holds, as vLLM's running requests keep their KV.

Children compute `context + segment` where the context follows the
`chunk_context` mode: the deployment's sink token (`sink`), the system
segment (`system`) or nothing (`none`); the system segment (always at
position 0) is computed alone. The manager never blocks: the engine glue
polls it.
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
# The flags a refused client can change (named in the error message).
POOL_FLAGS = "--chunk-pool-fraction or --chunk-pool-size-gib"


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
    """What `ChunkCacheManager.admit` decided."""

    # The parent request.
    request_id: str
    # ADMITTED, DEFERRED (ask again later) or a refusal.
    reason: AdmitReason
    # Cached segments in prompt order (empty unless admitted).
    segments: tuple[CachedSegment, ...] = ()
    # For refusals: what the client is told.
    message: str = ""
    # The children and store fetches this admission started (handed out
    # once, by the decision that made it).
    children: tuple[ChildSpec, ...] = ()
    fetches: tuple[FetchSpec, ...] = ()


@dataclass
class _Parent:
    prompt: ChunkedPrompt
    namespace: ChunkNamespace
    # Loaded and computed stretches of the prompt (boundary recompute).
    plan: PrefillPlan
    # QUEUED until admitted; a refusal is final.
    reason: AdmitReason | None = None
    segments: tuple[CachedSegment, ...] = ()
    # Distinct keys this parent holds a pin on, in prompt order (released
    # in that order, so earlier segments become older in the LRU).
    pinned: list[ChunkHash] = field(default_factory=list)
    # Distinct keys whose child has not finished yet.
    waiting_on: set[ChunkHash] = field(default_factory=set)
    # Counted in `deferred_requests` already.
    was_deferred: bool = False
    # Arrival order (the queue's order, also after a re-admission).
    seq: int = 0
    # The manager's epoch when the parent was admitted.
    epoch: int = 0
    # Opaque to the manager: what the engine glue builds its children from.
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
    # Segment ids and context ids, inserted into the index on success.
    segment_ids: list[int]
    context_ids: list[int]
    # How many times this key's child has been started.
    attempt: int = 1
    # Parents waiting for this child.
    waiters: set[str] = field(default_factory=set)
    # Set when this is a store fetch, not a computing child (issue 31).
    fetch: FetchSpec | None = None


@dataclass(frozen=True)
class _SegmentKey:
    chunk_hash: ChunkHash
    segment_ids: list[int]
    context_ids: list[int]
    # The namespace the key was made in (with the epoch).
    namespace: ChunkNamespace
    # segment_ids and context_ids as `token_bytes` serialises them, which
    # the key hashes and `_classify` verifies (issue 52: serialised once per
    # admission). None in a key rebuilt from a child (`_key_of`), which is
    # only ever started again, never classified.
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
            raise ValueError("chunk_context='sink' needs a sink token id")
        self.sink_token_id = sink_token_id
        self.pool = ChunkBlockPool(num_pool_blocks, block_size)
        self._parents: dict[str, _Parent] = {}
        # Parents not admitted yet, in arrival order.
        self._queued: OrderedDict[str, None] = OrderedDict()
        self._children: dict[str, _Child] = {}
        # Failed fetches (still in flight, in _children) whose rows a store
        # call holds and that the pool had no other room for: their children
        # start when the rows come back (`rows_returned`).
        self._waiting_for_rows: set[str] = set()
        # Failed fetches whose rows a store call holds (waiting or relocated)
        # -> when they failed; written off past `held_limit_s` by
        # `write_off_held` (None: held until returned). The clock is
        # injectable for tests.
        self.held_limit_s = held_limit_s
        self.clock = time.monotonic
        self._held_since: dict[str, float] = {}
        self._child_by_hash: dict[ChunkHash, str] = {}
        self._refusals: list[ChunkRefusal] = []
        self._num_children_created = 0
        self._num_parents_seen = 0
        # Bumped by `reset`; mixed into every key.
        self._epoch = 0
        # The fleet-wide store (issue 31), None without --chunk-store: then
        # nothing below about fetches ever runs.
        self.store_probe = store
        # Entries whose put was handed out and not yet carried by a step's
        # metadata: pinned until it is (`puts_shipped`).
        self._put_pins: list[ChunkHash] = []
        self._stats = ChunkCacheStats()

    # ------------------------------------------------------------ parents

    def add_request(
        self,
        request_id: str,
        prompt: ChunkedPrompt,
        namespace: ChunkNamespace,
        origin: object = None,
    ) -> None:
        """A chunked request arrived (nothing is pinned until `admit`).
        `origin` is handed back in the specs of the children its admission
        starts (ChildSpec.origin)."""
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

        Idempotent: an admitted or refused parent gets its decision again,
        except one admitted before a `reset`, which is admitted afresh.
        """
        parent = self._require_parent(request_id)
        if parent.reason == AdmitReason.ADMITTED and parent.epoch != self._epoch:
            self._requeue(request_id, parent)
        if parent.reason is not None:
            return ChunkAdmission(request_id, parent.reason, parent.segments)
        if next(iter(self._queued)) != request_id:
            return self._defer(request_id, parent)
        prompt = parent.prompt
        # NOTE: the epoch makes keys from before a reset unreachable, while
        # their retired entries may still be pinned under the old keys.
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

        # Classify each distinct key once; nothing is pinned until the pool
        # reserves every pin and allocation below in one step.
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
            # NOTE: an existence query is still in flight: wait a step (not
            # counted as deferred; the scheduler never waits on the network).
            return ChunkAdmission(request_id, AdmitReason.DEFERRED)
        # NOTE: residents and in-flight entries are pinned before the new
        # entries are allocated, so that those allocations cannot evict them.
        reservation = self.pool.reserve(
            [h for h, s in status_of.items() if s != SegmentStatus.MISSING],
            [(k.chunk_hash, len(k.segment_ids)) for k in missing],
        )
        if reservation is None:
            return self._defer(request_id, parent)

        children: list[ChildSpec] = []
        fetches: list[FetchSpec] = []
        for key in missing:
            if key.chunk_hash in store_hits:
                fetches.append(
                    self._start_fetch(key, store_hits[key.chunk_hash], parent.origin)
                )
            else:
                children.append(self._new_child(key, 1, parent.origin))
            self.pool.pin(key.chunk_hash)  # the parent's own pin, besides the writer's

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
        """The parent's decision for this scheduler step (None: not a chunked
        request this manager knows): admitted now if it can be, the children
        and store fetches that started, and, once ready, every cached
        segment's rows with the pool blocks it pins (stable until it is
        released: a pinned entry is never evicted or moved).

        `admit=False` for a running parent: it keeps the admission it runs
        with, also one from before a reset (as vLLM's running requests keep
        their KV); nothing starts."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        children: tuple[ChildSpec, ...] = ()
        fetches: tuple[FetchSpec, ...] = ()
        if admit:
            admission = self.admit(request_id)
            reason, children, fetches = (
                admission.reason,
                admission.children,
                admission.fetches,
            )
        else:
            reason = parent.reason or AdmitReason.DEFERRED
        # NOTE: the one definition of ready: admitted, every segment resident.
        ready = parent.reason == AdmitReason.ADMITTED and not parent.waiting_on
        segments = ()
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
            request_id, reason, ready, parent.plan, segments, children, fetches
        )

    def record_load(self, plan: ChunkLoadPlan) -> None:
        """Count a plan whose rows were sent to the workers (a decision's
        `load_plan` is a query: a plan dropped, e.g. for a request preempted
        in the same step, or asked twice, loads nothing)."""
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
        """Forget every cached segment (vLLM's cache reset: the weights may
        have changed, or a sleep discarded the pool's memory).

        Unpinned entries are freed now; pinned ones are retired (freed on
        their last unpin, never found again). True if nothing was pinned,
        as vLLM's prefix cache answers a reset while blocks are in use.
        """
        usage = self.pool.usage()
        self._epoch += 1
        self.pool.retire_all()
        return usage.num_entries == usage.num_evictable

    def take_refusals(self) -> list[ChunkRefusal]:
        """Parents refused since the last call; the engine finishes each with
        an error (they stay known until `release`)."""
        refusals, self._refusals = self._refusals, []
        return refusals

    # ----------------------------------------------------------- children

    def finish_child(
        self, child_request_id: str, stored: bool, ended: str = ""
    ) -> Outcome:
        """A child request ended, with its rows stored or without (`ended`:
        how): the parents now ready, its retry, and (with a store) its entry
        to write, unless a reset retired it (computed with weights that may
        be gone)."""
        child = self._pop_child(child_request_id)
        if not stored:
            return self._child_failed(child, ended)
        return self._child_finished(child, put=self.store_probe is not None)

    def puts_shipped(self) -> None:
        """The step's metadata now carries every put handed out since the last
        call. NOTE (issue 50, finding 3): a put's entry is pinned from the
        child's finish until here, so no allocation of this step (they all
        come before its metadata) reuses its blocks: the worker copies a put's
        rows in this step's `start_load_kv`, which vLLM 0.32 runs after the
        forward, so a child given those blocks in this step would have its
        rows copied under the put's key. A step scheduled later (even ahead,
        with async scheduling) runs after this one on the workers, so its
        writes come after the copy, and the pin can go now. It must: an idle
        engine runs no further step, and a pin held for one would keep
        `reset_prefix_cache` answering False for good."""
        for chunk_hash in self._put_pins:
            self.pool.unpin(chunk_hash)
        self._put_pins = []

    def store_report(self, result: ReportResult) -> Outcome:
        """The store's decisions from the workers' report of a step: fetches
        done, failed (computed by a child, in new blocks if their rows are
        still lent, or once they are returned), rows returned.

        NOTE: returned rows first: the blocks they free may be the room a
        failed fetch below needs to compute elsewhere."""
        started = [self._rows_returned(fetch_id) for fetch_id in result.rows_returned]
        ready: list[str] = []
        for fetch_id in result.done:
            fetch = self._pop_child(fetch_id)
            assert fetch.fetch is not None
            # NOTE: a fetch read and verified into its rows by every worker
            # ends as a child that stored them (no put: the store has it).
            ready += self._child_finished(fetch, put=False).ready
        started += [
            self._fetch_failed(f.fetch_id, rows_lent=f.rows_held) for f in result.failed
        ]
        return Outcome(
            children=tuple(c for c in started if c is not None), ready=tuple(ready)
        )

    def write_off_held(self) -> Outcome:
        """Once per scheduler step: failed fetches whose rows a store call has
        held for `held_limit_s` are written off (`Outcome.written_off`, for the
        store to forget them; a later return is ignored), with the children that
        compute a waiting fetch elsewhere.

        NOTE: a step's, not a report's: workers report only what changed, and a
        call that never returns changes nothing, so an engine whose every
        request waited for held rows sent no report and waited for good. An
        engine that runs no step at all (no request) writes off at its next
        step: nothing waits for the rows meanwhile."""
        if not self._held_since:
            return Outcome()
        now = self.clock()
        expired = [
            f
            for f, since in self._held_since.items()
            if now - since >= self.held_limit_s
        ]
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
        # NOTE (issue 50, finding 3): with a put, the writer's pin becomes the
        # put's until the worker copied its rows (puts_shipped). A retired
        # entry (computed before a reset) is neither published nor written.
        if not self.pool.publish(h, child.segment_ids, child.context_ids, keep_pin=put):
            return Outcome(ready=tuple(ready))
        if not put:
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
        """The child ended without storing (`ended`: how, for the message):
        its retry, if any.

        NOTE: the entry keeps its blocks and pins for the retry; after the
        last attempt its waiters are refused (never served otherwise).
        """
        self._stats.failed_children += 1
        if child.attempt < MAX_CHILD_ATTEMPTS:
            return Outcome(
                children=(
                    self._new_child(
                        self._key_of(child),
                        child.attempt + 1,
                        child.spec.origin,
                        child.waiters,
                    ),
                )
            )
        h = child.spec.chunk_hash
        how = f", the last ended {ended}" if ended else ""
        unpins = self._refuse_waiters(
            child,
            f"({len(child.segment_ids)} tokens, chunk key {h.hex()[:16]}) could "
            f"not be computed ({MAX_CHILD_ATTEMPTS} attempts{how}); the request is "
            "refused rather than served with another attention",
        )
        # NOTE: the entry's own pins (its waiters' and the writer's) drop
        # last, and the entry with them: nothing of it was stored.
        self.pool.unpin_all(unpins + [h] * (len(child.waiters) + 1), free=h)
        return Outcome()

    # ------------------------------------------------ store fetches (#31)

    @property
    def epoch(self) -> int:
        return self._epoch

    def _fetch_failed(
        self, fetch_id: str, *, rows_lent: bool = False
    ) -> ChildSpec | None:
        """A worker's read failed (absent, corrupt, timeout, error): the
        entry is computed by a normal child instead, with the same pins;
        never served from the store.

        `rows_lent`: some rank's store call may still write into the fetch's
        pool rows (issue 39, finding 9). Then the child computes into new
        blocks and the old ones stay held under `fetch_id` until
        `rows_returned(fetch_id)`. If the pool has no room for new blocks now,
        the fetch waits in flight (its entry, blocks, pins and waiters kept;
        None is returned) and `rows_returned` starts its child in its own
        blocks once nothing can write there any more.
        """
        fetch = self._require_child(fetch_id)
        assert fetch.fetch is not None
        if rows_lent:
            if self.held_limit_s is not None:
                self._held_since[fetch_id] = self.clock()
            if self.pool.relocate(fetch.spec.chunk_hash, holder=fetch_id) is None:
                # NOTE: no room: waiting costs the requests the rest of the
                # store's call (bounded by its timeout); refusing them would
                # fail requests a full pool could still serve exactly.
                self._waiting_for_rows.add(fetch_id)
                return None
        return self._compute_failed_fetch(fetch_id)

    def _rows_returned(self, fetch_id: str) -> ChildSpec | None:
        """Every rank's store call of a failed fetch lent with `fetch_failed`
        has returned: its former pool blocks are free again, or, for a fetch
        that waited for them, its child starts in them (returned). Raises
        KeyError for a fetch whose rows were not held."""
        self._held_since.pop(fetch_id, None)
        if fetch_id in self._waiting_for_rows:
            self._waiting_for_rows.discard(fetch_id)
            return self._compute_failed_fetch(fetch_id)
        self.pool.release_held(fetch_id)
        return None

    def _rows_written_off(self, fetch_id: str) -> ChildSpec | None:
        """A failed fetch's rows were lent longer than the store's held-rows
        limit (its call may never return): its blocks leave the pool for good.
        A fetch that waited for them is computed in new blocks (returned) if the
        pool has room, else its waiters are refused. Raises KeyError for a fetch
        whose rows were not held.

        NOTE (issue 50, finding 4): without a bound, a call that never returns
        (RDMA, long MC_* timeouts) held its blocks, and any parent waiting on it,
        for good."""
        self._held_since.pop(fetch_id, None)
        if fetch_id not in self._waiting_for_rows:
            self.pool.write_off(fetch_id)
            return None
        self._waiting_for_rows.discard(fetch_id)
        h = self._require_child(fetch_id).spec.chunk_hash
        if self.pool.relocate(h, holder=fetch_id) is not None:
            self.pool.write_off(fetch_id)
            return self._compute_failed_fetch(fetch_id)
        entry = self.pool.get(h)
        assert entry is not None
        fetch = self._pop_child(fetch_id)
        self.pool.unpin_all(
            self._refuse_waiters(
                fetch,
                "was being read from the chunk store, whose call never returned the "
                f"pool rows it was given; those {len(entry.block_ids)} pool block(s) are "
                "written off, and the pool has no other room to compute it now, so the "
                "request is refused rather than kept waiting",
            )
        )
        self.pool.detach(h, holder=fetch_id)
        self.pool.write_off(fetch_id)
        return None

    def _compute_failed_fetch(self, fetch_id: str) -> ChildSpec:
        fetch = self._pop_child(fetch_id)
        return self._new_child(self._key_of(fetch), 1, fetch.spec.origin, fetch.waiters)

    def _probe_store(
        self, missing: list["_SegmentKey"], namespace: ChunkNamespace
    ) -> dict[ChunkHash, int] | None:
        """Store hits among `missing` (key -> content hash); None while a
        query has not answered."""
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

    def _start_fetch(
        self, key: "_SegmentKey", content_hash: int, origin: object
    ) -> FetchSpec:
        # NOTE: registered as an in-flight child (same pins, waiters and
        # joins), but handed out as a fetch, never as a vLLM request.
        spec = self._register(FETCH_ID_PREFIX, key, origin, content_hash=content_hash)
        fetch = self._children[spec.request_id].fetch
        assert fetch is not None
        return fetch

    # -------------------------------------------------------------- stats

    def stats(self) -> ChunkCacheStats:
        usage = self.pool.usage()
        return dataclasses.replace(
            self._stats,
            evictions=usage.num_evictions,
            pool_blocks_used=usage.blocks_used,
            pool_blocks_total=usage.blocks_total,
            pinned_entries=usage.num_entries - usage.num_evictable,
            live_requests=len(self._parents) + len(self._children),
            # NOTE (finding 4): a fetch waiting for its lent rows holds its own.
            pool_blocks_held=usage.blocks_held
            + sum(
                len(self.pool.get(self._children[f].spec.chunk_hash).block_ids)
                for f in self._waiting_for_rows
            ),
        )

    # ----------------------------------------------------------- internal

    def _segment_keys(
        self,
        prompt: ChunkedPrompt,
        namespace: ChunkNamespace,
        ns_digest: bytes,
    ) -> list[_SegmentKey]:
        """Every cached segment's key. The prompt's cached ids are serialised
        once (issue 52): each key hashes its slice of those bytes, and
        `_classify` verifies the same slice (no per-segment conversion)."""
        spans = prompt.cached_spans
        data = token_bytes(prompt.token_ids[: spans[-1].end])
        keys = []
        context_ids: list[int] | None = None
        context = b""
        for index, span in enumerate(spans):
            segment_ids = prompt.segment_tokens(index)
            ids = segment_context(prompt, index, self.context_mode, self.sink_token_id)
            if ids != context_ids:
                # NOTE: one context for every chunk in each mode today; a
                # context that differs is serialised anew, so this holds
                # whatever segment_context returns.
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
        # NOTE: admission's keys carry their bytes (`_segment_keys`); only a
        # key rebuilt from a child (`_key_of`, never classified) has none.
        assert key.tokens is not None and key.context is not None
        residence = self.pool.find_bytes(h, key.tokens, key.context)
        if residence == Residence.COLLISION:
            self._stats.hash_collisions += 1
            return None
        if residence == Residence.RESIDENT:
            return SegmentStatus.RESIDENT
        return SegmentStatus.MISSING

    def _let_go(
        self, request_id: str, parent: _Parent, skip: ChunkHash | None = None
    ) -> list[ChunkHash]:
        """The parent stops waiting for its children; its pins to drop, in
        prompt order (except on `skip`)."""
        for h in parent.waiting_on - {skip}:
            # NOTE: absent when the child itself just ended.
            child_id = self._child_by_hash.get(h)
            if child_id is not None:
                self._children[child_id].waiters.discard(request_id)
        return [h for h in parent.pinned if h != skip]

    def _requeue(self, request_id: str, parent: _Parent) -> None:
        """Undo an admission from an older epoch: drop its pins and put the
        parent back in the queue at its arrival place."""
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
        """Refuse every parent waiting for `child`: its client is told which
        segment `what` happened to, and that nothing of it was kept (so a
        retry is safe). Returns their pins to drop, in order, except on the
        child's own entry (the caller drops those with the entry)."""
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
        # NOTE: one counter for children and store fetches, so no two internal
        # requests of this engine ever share an id.
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
        spec = self._register(CHILD_REQUEST_PREFIX, key, origin, attempt, waiters)
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
    ) -> ChildSpec:
        """A new in-flight writer of `key`'s entry: a child, or with a
        `content_hash` a store fetch."""
        h = key.chunk_hash
        spec = ChildSpec(
            request_id=self._internal_id(prefix, h),
            chunk_hash=h,
            token_ids=key.context_ids + key.segment_ids,
            store_start=len(key.context_ids),
            pool_block_ids=self._pool_blocks(h),
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
        self._children[spec.request_id] = _Child(
            spec=spec,
            segment_ids=key.segment_ids,
            context_ids=key.context_ids,
            attempt=attempt,
            waiters=set() if waiters is None else waiters,
            fetch=fetch,
        )
        self._child_by_hash[h] = spec.request_id
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
            s.span.num_tokens for s in segments if s.status == SegmentStatus.RESIDENT
        )

    def _pool_blocks(self, h: ChunkHash) -> tuple[PoolBlockId, ...]:
        return tuple(self._pool_block_list(h))

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
    """What segment `index` is computed after, which its key includes: a
    segment's entry is one per distinct (context, tokens)."""
    if index == 0 or mode == ChunkContextMode.NONE:
        # NOTE: the system segment is always at position 0 and sees nothing
        # before it, so it is computed alone in every mode.
        return []
    if mode == ChunkContextMode.SINK:
        # NOTE: a constant of the deployment, never the request's first
        # token, so the key does not depend on the system prompt.
        assert sink_token_id is not None
        return [sink_token_id]
    return prompt.segment_tokens(0)


def pool_blocks_for(
    prompt: ChunkedPrompt, block_size: int, context_mode: ChunkContextMode
) -> int:
    """Pool blocks the prompt's distinct cached segments need, as admission
    counts them (the front end refuses an oversized request with a 400
    before it reaches the engine): one entry per distinct key, by the rule
    of `segment_context`. NOTE: any sink stands for the deployment's here
    (one constant for every chunk: the same keys are distinct)."""
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
