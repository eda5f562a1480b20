# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The connector's scheduler half: vLLM events in, block-id metadata out.

A thin adapter around `ChunkCacheManager`, which owns every chunked request's
state and counter. It keeps only vLLM-side facts: this step's decisions and
allocations (`_loads`, step_loads.py) and each child's spec and paged blocks
(`_children`, until it finishes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import takewhile
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import PrefillGap
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
    ChildStore,
    ChunkCacheMetadata,
    RequestLoad,
    SegmentStretch,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.recompute_step import (
    RecomputeSteps,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
    POOL_BLOCK_SIZE,
    pool_num_blocks,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.stats import (
    ChunkCacheConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.step_loads import (
    StepLoads,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    check_scheduler,
    kv_cache_block_size,
)
from vllm.logger import init_logger
from vllm.v1.core.chunk_cache_manager import ChunkCacheManager
from vllm.v1.core.chunk_lora_identity import lora_identity
from vllm.v1.core.chunk_step_decision import Outcome
from vllm.v1.core.chunk_store_probe import FetchSpec
from vllm.v1.core.chunk_structures import (
    AdmitReason,
    ChildSpec,
    ChunkCacheStats,
    ChunkContextMode,
    ChunkedPrompt,
    ChunkNamespace,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.lookups import (
        StoreClient,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass(frozen=True)
class _ChildOrigin:
    """What a child request inherits from the parent whose admission started
    it (ChildSpec.origin): Request's arguments of these names."""

    client_index: int
    arrival_time: float
    lora_request: Any
    cache_salt: str | None
    priority: int
    block_hasher: Any


@dataclass
class _ChildSlots:
    spec: ChildSpec
    # Grows with chunked prefill.
    block_ids: list[int] = field(default_factory=list)
    # When it was first scheduled: its compute time, for the store's ReadCost.
    first_scheduled: float | None = None


class ChunkCacheSchedulerAdapter:
    """Scheduler-side half of the connector (engine-core process)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        cfg = vllm_config.chunk_cache_config
        check_scheduler(vllm_config)
        self.block_size = kv_cache_block_size(kv_cache_config)
        num_pool_blocks = pool_num_blocks(vllm_config, kv_cache_config)
        self.store = self._start_store(vllm_config)
        self.manager = ChunkCacheManager(
            num_pool_blocks,
            POOL_BLOCK_SIZE,
            ChunkContextMode(cfg.chunk_context),
            sink_token_id=cfg.chunk_sink_token_id,
            recompute_tokens=cfg.chunk_recompute_tokens,
            store=self.store,
            held_limit_s=None if self.store is None else self.store.held_limit_s,
        )
        model_config = vllm_config.model_config
        self._model = str(model_config.model)
        self._tokenizer = str(model_config.tokenizer)
        self._kv_dtype = f"{model_config.dtype}/{vllm_config.cache_config.cache_dtype}"
        self._child_params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            skip_reading_prefix_cache=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        self._children: dict[str, _ChildSlots] = {}
        self._new_children: list[Request] = []
        self._reported = ChunkCacheStats()
        self._steps = RecomputeSteps.for_config(vllm_config)
        # This step's decisions, reports and allocations (step_loads.py).
        self._loads = StepLoads(cfg.max_chunk_load_tokens)
        if cfg.chunk_recompute_tokens:
            logger.info(
                "Chunk cache: --chunk-recompute-tokens %d: %s",
                cfg.chunk_recompute_tokens,
                self._steps.reason,
            )
        logger.info(
            "Chunk cache: pool of %d blocks x %d rows, --chunk-context %s",
            num_pool_blocks,
            POOL_BLOCK_SIZE,
            cfg.chunk_context,
        )

    def on_new_request(self, request: Request) -> None:
        layout = request.chunk_layout
        if layout is None or request.prompt_token_ids is None:
            return
        prompt = ChunkedPrompt.from_lengths(request.prompt_token_ids, layout)
        namespace = ChunkNamespace(
            model=self._model,
            kv_dtype=self._kv_dtype,
            tokenizer=self._tokenizer,
            # By content, not name (chunk_lora_identity.py).
            lora_name=lora_identity(request.lora_request),
            cache_salt=request.cache_salt,
        )
        # The child carries its parent's salt: its blocks in vLLM's prefix
        # cache stay in the tenant's namespace.
        origin = _ChildOrigin(
            request.client_index,
            request.arrival_time,
            request.lora_request,
            request.cache_salt,
            request.priority,
            request._block_hasher,
        )
        self.manager.add_request(request.request_id, prompt, namespace, origin)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        if request.chunk_layout is None:
            return 0, False
        decision = self.manager.decide(rid)
        if decision is None:
            return 0, False
        self._loads.decided(rid, decision)
        self._hand_out(decision.children, decision.fetches)
        if decision.reason != AdmitReason.ADMITTED or not decision.ready:
            # A refused request waits until take_failed_requests ends it.
            return None, False
        return self._loads.matched_tokens(rid, num_computed_tokens), False

    def get_prefill_gap(
        self, request: Request, num_computed_tokens: int
    ) -> PrefillGap | None:
        rid = request.request_id
        if request.chunk_layout is None:
            return None
        decision = self._loads.decision(rid)
        if decision is None:
            # A running request keeps the admission it runs with.
            decision = self.manager.decide(rid, admit=False)
            if decision is None:
                return None
            self._loads.decided(rid, decision)
        if not decision.runs:
            return None
        return self._loads.gap(rid, num_computed_tokens, self._steps.one_step)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._loads.allocated(
            request.request_id, list(blocks.get_block_ids()[0]), num_external_tokens
        )

    def reset(self) -> bool:
        """VLLM's cache reset (`reset_prefix_cache(reset_connector=True)`,
        `pause_generation(clear_cache=True)`, sleep level >= 1)."""
        stats = self.manager.stats()
        complete = self.manager.reset()
        logger.info(
            "chunk cache reset: %d pool blocks dropped, %d entries still pinned by "
            "running requests are retired (freed when they finish)",
            stats.pool_blocks_used,
            stats.pinned_entries,
        )
        return complete

    def take_internal_requests(self) -> list[Request]:
        children, self._new_children = self._new_children, []
        return children

    def take_failed_requests(self) -> dict[str, str]:
        """Refused parents -> the error message their client gets."""
        failed = {}
        for refusal in self.manager.take_refusals():
            logger.warning(
                "chunk cache: request %s refused: %s",
                refusal.request_id,
                refusal.message,
            )
            failed[refusal.request_id] = refusal.message
        return failed

    def request_finished(self, request: Request) -> None:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        slots = self._children.pop(rid, None)
        if slots is not None:
            ok = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
            stored = request.status in ok and (
                request.num_computed_tokens >= request.num_prompt_tokens
            )
            if stored and self.store is not None and slots.first_scheduled is not None:
                self.store.note_child_computed(
                    len(slots.spec.token_ids), time.monotonic() - slots.first_scheduled
                )
            outcome = self.manager.finish_child(rid, stored, ended=request.status.name)
            if not stored:
                logger.warning(
                    "chunk cache: child %s ended without its rows (%s); %s",
                    rid,
                    request.status.name,
                    f"retrying as {outcome.children[0].request_id}"
                    if outcome.children
                    else "giving up",
                )
            self._hand_out(outcome.children, put=outcome)
            return
        self._loads.forget(rid)
        self.manager.release(rid)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> ChunkCacheMetadata:
        meta = ChunkCacheMetadata()
        self._add_loads(meta, scheduler_output)
        self._add_stores(meta, scheduler_output)
        self._loads.end_step()
        if self.store is not None:
            self._write_off_held(self.store)
            meta.store = self.store.take_step(self.manager.epoch)
            self.manager.puts_shipped()
        return meta

    def _add_loads(self, meta: ChunkCacheMetadata, out: SchedulerOutput) -> None:
        # A request preempted later in the step it was allocated in is not in
        # its scheduled tokens, and its load must not run. Not
        # `preempted_req_ids`: vLLM 0.32 also lists there a request preempted
        # between steps and resumed in this one, whose load must run.
        for rid, pending in self._loads.pending().items():
            if rid not in out.num_scheduled_tokens:
                continue
            plan = pending.load_plan()
            self.manager.record_load(plan)
            stretches = [SegmentStretch.of(seg) for seg in plan.segments]
            # Rows of vLLM's null blocks (out of every later token's sliding
            # window) are not written (docs/design/sliding-window.md).
            skipped = _leading_null_blocks(pending.block_ids) * self.block_size
            if skipped:
                stretches = [
                    t
                    for t in (s.from_position(skipped) for s in stretches)
                    if t is not None
                ]
            if not stretches:
                continue
            meta.loads.append(
                RequestLoad(
                    block_ids=tuple(pending.block_ids),
                    stretches=tuple(stretches),
                )
            )

    def _add_stores(self, meta: ChunkCacheMetadata, out: SchedulerOutput) -> None:
        if not self._children:
            return
        scheduled: list[tuple[str, _ChildSlots, int]] = []
        for new in out.scheduled_new_reqs:
            child = self._children.get(new.req_id)
            if child is not None:
                child.block_ids = list(new.block_ids[0])
                scheduled.append((new.req_id, child, new.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            child = self._children.get(rid)
            if child is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                child.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                child.block_ids.extend(new_ids[0])
            scheduled.append((rid, child, cached.num_computed_tokens[i]))
        if self.store is not None:
            now = time.monotonic()
            for _, child, _ in scheduled:
                if child.first_scheduled is None:
                    child.first_scheduled = now
        num_scheduled, stores = out.num_scheduled_tokens, meta.stores
        for rid, child, start in scheduled:
            spec = child.spec
            lo = max(start, spec.store_start)
            hi = min(start + num_scheduled.get(rid, 0), len(spec.token_ids))
            if lo >= hi:
                continue
            blocks = tuple(child.block_ids)
            stores.append(
                ChildStore(blocks, spec.pool_block_ids, lo, hi, spec.store_start)
            )

    def take_stats(self) -> ChunkCacheConnectorStats:
        """Counter increments since the last call, plus the gauges."""
        now, last = self.manager.stats(), self._reported
        self._reported = now
        stats = ChunkCacheConnectorStats.increments(now, last)
        if self.store is not None:
            stats.data.update(self.store.counters.take())
        return stats

    def _start_store(self, vllm_config: VllmConfig) -> StoreClient | None:
        if vllm_config.chunk_cache_config.chunk_store is None:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store import (
            lookups,
        )

        return lookups.StoreClient(vllm_config)

    def on_store_report(self, report: Any) -> None:
        """The workers' store outcomes of a step (combined over ranks)."""
        if self.store is None:
            return
        outcome = self.manager.store_report(self.store.on_report(report))
        for spec in outcome.children:
            logger.info(
                "chunk store: computing %s as %s (its read failed)",
                spec.chunk_hash.hex()[:16],
                spec.request_id,
            )
        self._hand_out(outcome.children)

    def _write_off_held(self, store: StoreClient) -> None:
        """Rows a store call held past held_limit leave the pool (the manager
        decides when); the store forgets them."""
        outcome = self.manager.write_off_held()
        for fetch_id in outcome.written_off:
            store.write_off(fetch_id)
        for spec in outcome.children:
            logger.info(
                "chunk store: computing %s as %s (the rows its read was given "
                "are written off)",
                spec.chunk_hash.hex()[:16],
                spec.request_id,
            )
        self._hand_out(outcome.children)

    def _hand_out(
        self,
        children: tuple[ChildSpec, ...],
        fetches: tuple[FetchSpec, ...] = (),
        put: Outcome | None = None,
    ) -> None:
        """The one place specs become vLLM requests, store fetches and puts."""
        for spec in children:
            self._new_children.append(self._make_child(spec))
        if self.store is None:
            return
        for fetch in fetches:
            self.store.start_fetch(fetch, list(fetch.pool_block_ids))
        entry = None if put is None else put.put
        if entry is not None:
            self.store.queue_put(
                list(entry.token_ids),
                entry.store_start,
                entry.cache_salt,
                entry.lora,
                list(entry.pool_block_ids),
                entry.epoch,
            )

    def _make_child(self, spec: ChildSpec) -> Request:
        from vllm.v1.request import Request

        assert isinstance(spec.origin, _ChildOrigin)
        child = Request(
            request_id=spec.request_id,
            prompt_token_ids=list(spec.token_ids),
            sampling_params=self._child_params.clone(),
            pooling_params=None,
            **vars(spec.origin),
        )
        self._children[spec.request_id] = _ChildSlots(spec)
        return child


# vLLM's null block (BlockPool.null_block: the first block, never allocated).
NULL_BLOCK_ID = 0


def _leading_null_blocks(block_ids: list[int]) -> int:
    """How many of a request's first blocks are vLLM's null block."""
    return sum(1 for _ in takewhile(NULL_BLOCK_ID.__eq__, block_ids))
