# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ChunkCacheConnector: the chunk cache as a KV connector, delegating to
`ChunkCacheSchedulerAdapter` (scheduler role) or `ChunkCacheWorker` (worker)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    PrefillGap,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
    ChunkCacheMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.scheduler_adapter import (
    ChunkCacheSchedulerAdapter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.stats import (
    ChunkCacheConnectorStats,
    ChunkCachePromMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    CAPTURE_IN_ATTENTION,
    CONNECTOR_NAME,
)

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class ChunkCacheConnector(KVConnectorBase_V1):
    """KV connector of the position-independent chunk cache."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        if not vllm_config.chunk_cache_config.enable_chunk_cache:
            # vLLM calls the hooks it lives on only with the flag on.
            raise ValueError(
                f"{CONNECTOR_NAME} is turned on with --enable-chunk-cache, not "
                "through --kv-transfer-config (alone or inside MultiConnector)"
            )
        super().__init__(vllm_config, role, kv_cache_config)
        self._scheduler: ChunkCacheSchedulerAdapter | None = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ChunkCacheSchedulerAdapter(vllm_config, kv_cache_config)
        else:
            from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import (
                worker,
            )

            self._worker = worker.ChunkCacheWorker(vllm_config, kv_cache_config)

    @property
    def chunk_scheduler(self) -> ChunkCacheSchedulerAdapter:
        assert self._scheduler is not None
        return self._scheduler

    def on_new_request(self, request: Request) -> None:
        self.chunk_scheduler.on_new_request(request)

    def take_internal_requests(self) -> list[Request]:
        return self.chunk_scheduler.take_internal_requests()

    def take_failed_requests(self) -> dict[str, str]:
        return self.chunk_scheduler.take_failed_requests()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.chunk_scheduler.get_num_new_matched_tokens(
            request, num_computed_tokens
        )

    def get_prefill_gap(
        self, request: Request, num_computed_tokens: int
    ) -> PrefillGap | None:
        return self.chunk_scheduler.get_prefill_gap(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.chunk_scheduler.update_state_after_alloc(
            request, blocks, num_external_tokens
        )

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        return self.chunk_scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.chunk_scheduler.request_finished(request)
        return False, None

    def reset_cache(self) -> bool:
        # Called on the scheduler's connector only: the workers' rows are
        # never read again once the manager forgot them.
        if self._scheduler is None:
            return True
        return self._scheduler.reset()

    def unregister_kv_caches(self) -> None:
        """Sleep and discard (vLLM 0.33) release the KV cache memory the pool
        lives in; the scheduler side is reset in the same pause (reset_cache)."""
        if self._worker is not None:
            self._worker.release_pool()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore_pool()

    def shutdown(self) -> None:
        """The store's calls holding this engine's memory get a deadline; one
        that misses it keeps that memory until it returns (StoreTransfers.close),
        so a later engine's pool never lies where a late read writes."""
        if (store := self._store) is not None:
            store.close(timeout_s=store.spec.timeout_s + 1.0)

    def get_kv_connector_stats(self) -> ChunkCacheConnectorStats | None:
        if self._scheduler is not None:
            return self._scheduler.take_stats()
        # A report every step, even empty: vLLM asks the scheduler side for its
        # counters only when a worker reported.
        store = self._store
        return ChunkCacheConnectorStats(data=store.take_counters() if store else {})

    def build_connector_worker_meta(self) -> Any:
        # The store's fetch outcomes and this rank's identity (store/transfers.py).
        return self._store.take_report() if self._store is not None else None

    @property
    def _store(self) -> Any:
        return self._worker.store if self._worker is not None else None

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if meta is not None and self._scheduler is not None:
            self._scheduler.on_store_report(meta)

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

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Captures left in the attention hook must run between piecewise
        # graphs (capture_path.py).
        return bool(extra_config.get(CAPTURE_IN_ATTENTION, True))

    def register_model(self, model: Any) -> None:
        assert self._worker is not None
        with self._released_if_refused():
            self._worker.register_model(model)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        with self._released_if_refused():
            self._worker.register_kv_caches(kv_caches)

    @contextmanager
    def _released_if_refused(self) -> Iterator[None]:
        """A start-up refusal also gives up vLLM's process-wide connector slot
        (`kv_transfer_state`): an engine whose start-up failed never shuts
        down, and the process's next engine would be handed this connector."""
        try:
            yield
        except BaseException:
            from vllm.distributed.kv_transfer import kv_transfer_state

            if (
                kv_transfer_state.has_kv_transfer_group()
                and kv_transfer_state.get_kv_transfer_group() is self
            ):
                kv_transfer_state.ensure_kv_transfer_shutdown()
            raise

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta(), forward_context)

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
        meta = self._meta()
        if not meta.stores:
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
        # After the forward, outside any CUDA graph: the rows are in place.
        assert self._worker is not None
        self._worker.capture_after_forward(self._meta())

    def _meta(self) -> ChunkCacheMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ChunkCacheMetadata)
        return meta
