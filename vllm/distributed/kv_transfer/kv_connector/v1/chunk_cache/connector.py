# SPDX-License-Identifier: Apache-2.0
"""ChunkCacheConnector: the chunk cache wired into vLLM as a KV connector.

Scheduler role (engine-core process), around `ChunkCacheManager`:
* `on_new_request`: a request whose cache salt carries a chunk layout (set
  by the renderer, see vllm/renderers/chunk_split.py) is admitted: each
  cached segment (system + chunks) is resident, in flight or missing; one
  internal child request per distinct missing segment computes
  `[context] + segment` (prefill only, max_tokens=1, prefix-cache reads
  off); the scheduler admits the children through `take_internal_requests`.
* `get_num_new_matched_tokens`: None (ask again next step) while a segment
  is still being computed, then every token before the question is
  reported as computed externally; the scheduler computes the question only.
* `build_connector_meta`: per step, the rows to capture from children
  (paged slot -> pool row) and the rows to load into parents (pool row ->
  paged slot, with the position delta).
* `request_finished`: a child's rows are in the pool (entry resident) or it
  failed; a parent drops its pins.

Worker role: see worker.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
    POOL_BLOCK_SIZE,
    pool_num_blocks,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.stats import (
    COUNTERS,
    ChunkCacheConnectorStats,
    ChunkCachePromMetrics,
)
from vllm.logger import init_logger
from vllm.renderers.chunk_split import chunked_prompt_from_salt
from vllm.v1.core.chunk_cache_manager import ChunkCacheManager
from vllm.v1.core.chunk_hash_index import ChunkNamespace
from vllm.v1.core.chunk_structures import ChunkContextMode, ChunkedPrompt

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

# Salt of child requests: their paged blocks are never shared with others.
CHILD_CACHE_SALT = "vllm-chunk-cache/child"


@dataclass
class ChunkCacheMetadata(KVConnectorMetadata):
    """One step's work for the workers (plain lists: cheap to pickle)."""

    # Load: pool row -> paged slot, rotate K by delta.
    load_src_rows: list[int] = field(default_factory=list)
    load_dst_slots: list[int] = field(default_factory=list)
    load_deltas: list[int] = field(default_factory=list)
    # Capture: token at paged slot -> pool row.
    store_src_slots: list[int] = field(default_factory=list)
    store_dst_rows: list[int] = field(default_factory=list)


@dataclass
class _Parent:
    prompt: ChunkedPrompt
    fallback: bool
    # Not admitted yet: the pool is full of entries pinned by other requests;
    # admission is retried every step (the request waits, never falls back).
    deferred: ChunkNamespace | None = None
    # (first position to load, paged block ids) once allocated.
    pending_load: tuple[int, list[int]] | None = None


@dataclass
class _Child:
    # Tokens of the child's sequence and the first one to store.
    num_tokens: int
    store_start: int
    # Pool row of each stored token.
    pool_rows: np.ndarray
    # Paged block ids of the child (grows with chunked prefill).
    block_ids: list[int] = field(default_factory=list)


def _rows_of_blocks(block_ids: list[int], block_size: int, positions: np.ndarray) -> np.ndarray:
    blocks = np.asarray(block_ids, dtype=np.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


class ChunkCacheScheduler:
    """Scheduler-side state of the connector."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        cfg = vllm_config.chunk_cache_config
        self.block_size = vllm_config.cache_config.block_size
        num_pool_blocks = pool_num_blocks(vllm_config, kv_cache_config)
        self.manager = ChunkCacheManager(
            num_pool_blocks, POOL_BLOCK_SIZE, ChunkContextMode(cfg.chunk_context)
        )
        model_config = vllm_config.model_config
        self._model = str(model_config.model)
        self._tokenizer = str(model_config.tokenizer)
        self._kv_dtype = f"{model_config.dtype}/{vllm_config.cache_config.cache_dtype}"
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}
        self._new_children: list[Request] = []
        # Parent request id -> number of prompt tokens served from the pool
        # (for stats), and counters the manager does not keep.
        self.num_child_computes = 0
        self.num_child_tokens = 0
        self.num_tokens_loaded = 0
        # Requests whose segments can never fit the pool (served normally),
        # and admissions retried because the pool was pinned full (the
        # manager counts each of those as a fallback; they are not).
        self.num_oversized = 0
        self.num_deferred_admissions = 0
        self._reported: dict[str, int] = {}
        logger.info(
            "Chunk cache: pool of %d blocks x %d rows, chunk_context=%s",
            num_pool_blocks,
            POOL_BLOCK_SIZE,
            cfg.chunk_context,
        )

    # ----------------------------------------------------------- requests

    def on_new_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._children or rid in self._parents:
            return
        if request.prompt_token_ids is None:
            return
        parsed = chunked_prompt_from_salt(request.prompt_token_ids, request.cache_salt)
        if parsed is None:
            return
        prompt, user_salt = parsed
        lora = request.lora_request
        namespace = ChunkNamespace(
            model=self._model,
            kv_dtype=self._kv_dtype,
            tokenizer=self._tokenizer,
            lora_id=lora.lora_int_id if lora is not None else 0,
            cache_salt=user_salt,
        )
        parent = _Parent(prompt=prompt, fallback=False)
        self._parents[rid] = parent
        needed = sum(
            self.manager.pool.blocks_needed(span.num_tokens)
            for span in prompt.cached_spans
        )
        if needed > self.manager.pool.num_blocks:
            # NOTE: can never fit, whatever is evicted: served as a normal
            # prefill (counted as a fallback; size the pool for the largest
            # request, see docs/user-guide.md).
            parent.fallback = True
            self.num_oversized += 1
            logger.warning(
                "chunk cache: request %s needs %d chunk-pool blocks, the pool has "
                "%d: it is computed without the chunk cache (full causal "
                "attention)",
                rid,
                needed,
                self.manager.pool.num_blocks,
            )
            return
        if not self._admit(request, parent, namespace) and parent.fallback:
            logger.warning(
                "chunk cache: request %s is computed without the chunk cache "
                "(hash collision)",
                rid,
            )

    def _admit(self, request: Request, parent: _Parent, namespace: ChunkNamespace) -> bool:
        """Admit a parent; False (deferred) while the pool is pinned full."""
        admission = self.manager.admit(request.request_id, parent.prompt, namespace)
        if admission.fallback:
            upper_bound = sum(
                self.manager.pool.blocks_needed(span.num_tokens)
                for span in parent.prompt.cached_spans
            )
            if self.manager.pool.can_allocate(upper_bound):
                # Room was not the problem: a key matched other tokens (hash
                # collision, counted by the manager). Serve it normally.
                parent.fallback = True
                parent.deferred = None
                return False
            # The pool is full of pinned entries right now: wait for them.
            self.num_deferred_admissions += 1
            parent.deferred = namespace
            return False
        parent.deferred = None
        for spec in admission.new_children:
            self._new_children.append(self._make_child(request, spec))
        return True

    def _make_child(self, parent: Request, spec: Any) -> Request:
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            skip_reading_prefix_cache=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        child = Request(
            request_id=spec.request_id,
            prompt_token_ids=list(spec.token_ids),
            sampling_params=params,
            pooling_params=None,
            client_index=parent.client_index,
            arrival_time=parent.arrival_time,
            lora_request=parent.lora_request,
            cache_salt=CHILD_CACHE_SALT,
            priority=parent.priority,
            block_hasher=parent._block_hasher,
        )
        plan = self.manager.store_plan(spec.request_id)
        offsets = np.arange(plan.num_tokens, dtype=np.int64)
        pool_rows = _rows_of_blocks(
            [int(b) for b in plan.pool_block_ids], POOL_BLOCK_SIZE, offsets
        )
        self._children[spec.request_id] = _Child(
            num_tokens=len(spec.token_ids),
            store_start=spec.store_start,
            pool_rows=pool_rows,
        )
        self.num_child_computes += 1
        self.num_child_tokens += len(spec.token_ids)
        return child

    def take_internal_requests(self) -> list[Request]:
        children, self._new_children = self._new_children, []
        return children

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        parent = self._parents.get(request.request_id)
        if parent is None or parent.fallback:
            return 0, False
        if parent.deferred is not None and not self._admit(
            request, parent, parent.deferred
        ):
            return (0, False) if parent.fallback else (None, False)
        if not self.manager.is_ready(request.request_id):
            return None, False
        end = parent.prompt.question_span.start
        return max(0, end - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        parent = self._parents.get(request.request_id)
        if parent is None or num_external_tokens == 0:
            return
        end = parent.prompt.question_span.start
        block_ids = list(blocks.get_block_ids()[0])
        parent.pending_load = (end - num_external_tokens, block_ids)

    # --------------------------------------------------------------- meta

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ChunkCacheMetadata:
        meta = ChunkCacheMetadata()
        self._add_loads(meta)
        self._add_stores(meta, scheduler_output)
        return meta

    def _add_loads(self, meta: ChunkCacheMetadata) -> None:
        for rid, parent in self._parents.items():
            if parent.pending_load is None:
                continue
            first, block_ids = parent.pending_load
            parent.pending_load = None
            plan = self.manager.load_plan(rid)
            for seg in plan.segments:
                lo = max(seg.dst_start, first)
                hi = seg.dst_start + seg.num_tokens
                if lo >= hi:
                    continue
                positions = np.arange(lo, hi, dtype=np.int64)
                offsets = positions - seg.dst_start
                src = _rows_of_blocks(
                    [int(b) for b in seg.pool_block_ids], POOL_BLOCK_SIZE, offsets
                )
                dst = _rows_of_blocks(block_ids, self.block_size, positions)
                meta.load_src_rows.extend(src.tolist())
                meta.load_dst_slots.extend(dst.tolist())
                meta.load_deltas.extend([seg.position_delta] * len(positions))
                self.num_tokens_loaded += len(positions)

    def _add_stores(self, meta: ChunkCacheMetadata, out: SchedulerOutput) -> None:
        if not self._children:
            return
        scheduled: list[tuple[str, int]] = []
        for new in out.scheduled_new_reqs:
            child = self._children.get(new.req_id)
            if child is not None:
                child.block_ids = list(new.block_ids[0])
                scheduled.append((new.req_id, new.num_computed_tokens))
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
            scheduled.append((rid, cached.num_computed_tokens[i]))
        for rid, start in scheduled:
            child = self._children[rid]
            n = out.num_scheduled_tokens.get(rid, 0)
            lo = max(start, child.store_start)
            hi = min(start + n, child.num_tokens)
            if lo >= hi:
                continue
            positions = np.arange(lo, hi, dtype=np.int64)
            meta.store_src_slots.extend(
                _rows_of_blocks(child.block_ids, self.block_size, positions).tolist()
            )
            meta.store_dst_rows.extend(
                child.pool_rows[positions - child.store_start].tolist()
            )

    # -------------------------------------------------------------- stats

    def snapshot(self) -> dict[str, int]:
        """Cumulative counters and pool gauges (see stats.COUNTERS)."""
        s = self.manager.stats()
        return {
            "hits": s.hits,
            "misses": s.misses,
            "in_flight_joins": s.in_flight_joins,
            "tokens_reused": s.tokens_reused,
            "tokens_loaded": self.num_tokens_loaded,
            "child_computes": self.num_child_computes,
            "child_tokens": self.num_child_tokens,
            "evictions": s.evictions,
            "fallbacks": s.fallbacks - self.num_deferred_admissions + self.num_oversized,
            "hash_collisions": s.hash_collisions,
            "failed_children": s.failed_children,
            "pool_blocks_used": s.pool_blocks_used,
            "pool_blocks_total": s.pool_blocks_total,
            "pinned_entries": self.num_pinned_entries(),
            "live_parents": len(self._parents),
            "live_children": len(self._children),
            "deferred_admissions": self.num_deferred_admissions,
        }

    def num_pinned_entries(self) -> int:
        pool = self.manager.pool
        usage = pool.usage()
        return usage.num_entries - usage.num_evictable

    def take_stats(self) -> ChunkCacheConnectorStats:
        """Counter increments since the last call, plus the pool gauges."""
        now = self.snapshot()
        data: dict[str, int] = {}
        for key in COUNTERS:
            data[key] = now[key] - self._reported.get(key, 0)
            self._reported[key] = now[key]
        data["pool_blocks_used"] = now["pool_blocks_used"]
        data["pool_blocks_total"] = now["pool_blocks_total"]
        data["pool_entries_pinned"] = now["pinned_entries"]
        return ChunkCacheConnectorStats(data=data)

    # ------------------------------------------------------------- finish

    def request_finished(self, request: Request) -> None:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        if rid in self._children:
            del self._children[rid]
            if request.status in (
                RequestStatus.FINISHED_STOPPED,
                RequestStatus.FINISHED_LENGTH_CAPPED,
            ) and request.num_computed_tokens >= request.num_prompt_tokens:
                self.manager.child_finished(rid)
            else:
                for parent_id in self.manager.child_failed(rid):
                    parent = self._parents.get(parent_id)
                    if parent is not None:
                        parent.fallback = True
                        logger.warning(
                            "chunk cache: a segment of request %s could not be "
                            "computed; the request falls back to a normal prefill",
                            parent_id,
                        )
            return
        parent = self._parents.pop(rid, None)
        if parent is not None and not parent.fallback and parent.deferred is None:
            self.manager.release(rid)


class ChunkCacheConnector(KVConnectorBase_V1):
    """KV connector of the position-independent chunk cache."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        self._scheduler: ChunkCacheScheduler | None = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ChunkCacheScheduler(vllm_config, kv_cache_config)
        else:
            from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.worker import (
                ChunkCacheWorker,
            )

            self._worker = ChunkCacheWorker(vllm_config, kv_cache_config)

    # ---------------------------------------------------------- scheduler

    @property
    def chunk_scheduler(self) -> ChunkCacheScheduler:
        assert self._scheduler is not None
        return self._scheduler

    def on_new_request(self, request: Request) -> None:
        self.chunk_scheduler.on_new_request(request)

    def take_internal_requests(self) -> list[Request]:
        return self.chunk_scheduler.take_internal_requests()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.chunk_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.chunk_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.chunk_scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.chunk_scheduler.request_finished(request)
        return False, None

    def get_kv_connector_stats(self) -> ChunkCacheConnectorStats | None:
        if self._scheduler is not None:
            return self._scheduler.take_stats()
        # Worker: an empty report every step, so that the scheduler adds its
        # own counters (vLLM only asks the scheduler side when a worker
        # reported something).
        return ChunkCacheConnectorStats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> ChunkCacheConnectorStats:
        return ChunkCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ChunkCachePromMetrics:
        return ChunkCachePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # ------------------------------------------------------------- worker

    def register_model(self, model: Any) -> None:
        assert self._worker is not None
        self._worker.register_model(model)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, ChunkCacheMetadata)
        self._worker.start_load_kv(meta, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, ChunkCacheMetadata)
        if not meta.store_src_slots:
            return
        from vllm.forward_context import get_forward_context

        slot_mapping = None
        slot_maps = get_forward_context().slot_mapping
        if isinstance(slot_maps, dict):
            slot_mapping = slot_maps.get(layer_name)
        if slot_mapping is None:
            slot_mapping = getattr(attn_metadata, "slot_mapping", None)
        self._worker.save_kv_layer(
            meta, layer_name, slot_mapping, kwargs.get("key"), kwargs.get("value")
        )

    def wait_for_save(self) -> None:
        return
