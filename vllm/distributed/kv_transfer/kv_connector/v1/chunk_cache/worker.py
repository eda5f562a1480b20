# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker side of the chunk cache: the pool tensors, capture and load.

Each layer's rope is read from the model by layer_ropes.py; the layers that
load through the fused GPU kernel are chosen by fused_chunk_load_path.py;
start-up refusals are support.py's.

* Pool: per layer, on the device of its paged KV cache, key [rows,
  num_kv_heads, head_size] and value [rows, num_kv_heads, head_size_v] in the
  model dtype (not vLLM's paged, ISA-packed or quantized layout), carved out
  of the KV cache budget (setup.carve_chunk_pool), never added on top.
* Capture (`wait_for_save`, after the forward): the rows a child computed
  this step are copied from its paged blocks into its pool rows through the
  backend's reader, on every layer whose start-up self-check passed
  (capture_path.py). A layer whose cache cannot be read back (quantized, or
  packed per CPU ISA) captures in the attention hook (`save_kv_layer`).
* Load (`start_load_kv`, before the forward, outside any CUDA graph): the
  step's block ids are expanded into rows on the device once
  (`LoadRows.expand`), cos/sin of each stretch's delta go over once per step
  and set of frequencies, and per layer the `PositionRemapper` gathers,
  rotates K and writes K/V through the backend's own cache-write op
  (cache_writers.py). On a GPU the self-checked layers load through one fused
  Triton kernel launch per step instead (fused_chunk_load_path.py). No device
  value is read back to the host.
* Sleep: only the pool, its load buffers and vLLM's caches live in the pool a
  sleep discards, and nothing reads their contents after one; the fused
  kernel's address table is built at the first load, outside it.
* fp8 KV caches: setup.pool_dtype. CUDA graphs: setup._resolve_cudagraph_mode
  and `check_graph_mode` (a full graph over a hook-captured layer is refused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
    latent_writer_for,
    writer_for,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.capture_path import (
    CaptureChoice,
    choose_capture,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.fused_chunk_load_path import (  # noqa: E501
    FusedLayers,
    FusedLoadChoice,
    choose_fused_layers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.layer_ropes import (
    find_layer_ropes,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
    LoadRows,
    StoreRows,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.mla_latent_layers import (
    LatentLayer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.recompute_step import (
    RecomputeSteps,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
    POOL_BLOCK_SIZE,
    load_scratch_rows,
    pool_dtype,
    pool_num_blocks,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    check_attention_layer,
    check_graph_mode,
    check_query_runs,
)
from vllm.logger import init_logger
from vllm.v1.worker.position_remapper import (
    PositionRemapper,
    RemapRows,
    RemapScratch,
    RopeRotation,
    StretchCosSin,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)
_T = TypeVar("_T")


def _table(
    stretches: dict[bytes, StretchCosSin], rotation: RopeRotation | None
) -> StretchCosSin | None:
    """The step's cos/sin of `rotation`'s frequencies; None without RoPE."""
    return None if rotation is None else stretches[rotation.frequency_key]


def _checked(found: _T | None) -> _T:
    """A layer's writer (or reader) that register_kv_caches checked is there."""
    assert found is not None, "checked in register_kv_caches"
    return found


def cache_device(kv_cache: torch.Tensor | Any) -> torch.device:
    """Device of a layer's paged cache: one tensor (vLLM's backends) or a
    (key_cache, value_cache) pair (vllm-ascend's standard attention)."""
    if isinstance(kv_cache, torch.Tensor):
        return kv_cache.device
    return kv_cache[0].device


def _backend_write(
    layer: Any,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The fused-load self-check's reference: the backend's own write into
    `kv_cache` (the layer's cache; the CUDA backends' `do_kv_cache_update`)."""
    layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


def _check_resident(pool_resident: bool) -> None:
    if not pool_resident:
        raise RuntimeError(
            "chunk cache: a step loads or captures chunks while vLLM's KV cache "
            "memory is released (sleep mode): the scheduler side was not reset "
            "before the sleep"
        )


class ChunkCacheWorker:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        self.vllm_config = vllm_config
        self.num_pool_rows = (
            pool_num_blocks(vllm_config, kv_cache_config) * POOL_BLOCK_SIZE
        )
        # The paged block size of the single KV cache group (support.py).
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.dtype = pool_dtype(vllm_config)
        self.device: torch.device | None = None
        self.pool_key: dict[str, torch.Tensor] = {}
        self.pool_value: dict[str, torch.Tensor] = {}
        self.remappers: dict[str, PositionRemapper] = {}
        # MLA layers: latent rows (mla_latent_layers.py).
        self.latent: dict[str, LatentLayer] = {}
        # The load buffers of the layers not fused, of the rows the carve-out
        # counts (setup.load_scratch_rows).
        self._scratch = RemapScratch(load_scratch_rows(vllm_config))
        self._ropes: dict[str, nn.Module | None] | None = None
        self._rotations: dict[int, RopeRotation] = {}
        # Layers the fused kernel loads (GPU, self-checked), and its launches.
        self._fused = FusedLoadChoice()
        self._fused_groups: list[FusedLayers] = []
        # Where each standard layer captures (capture_path.py).
        self._capture = CaptureChoice()
        # Fused-load launches whose layers all capture after the forward.
        self._capture_groups: list[FusedLayers] = []
        self._layers: dict[str, Any] = {}
        self._kv_caches: dict[str, Any] = {}
        self._forward_context: ForwardContext | None = None
        # This step's capture indices (the same for every layer).
        self._step_rows: torch.Tensor | None = None
        self._step_dst: torch.Tensor | None = None
        self._step_key: tuple[int, int] | None = None
        # Layers whose attention hook captured for the step of metadata
        # _hook_step (capture_after_forward checks all did). NOTE: never reset
        # in start_load_kv, which vLLM 0.32 calls after the forward in a step
        # without synchronous loads.
        self._hook_step: Any = None
        self._hook_captured: set[str] = set()
        # The fleet-wide store (store/transfers.py); None without --chunk-store.
        self.store: Any = None
        self._model: nn.Module | None = None
        # False between vLLM's unregister_kv_caches and restore_kv_caches
        # (vLLM 0.33's sleep and discard release the memory the pool is in).
        self.pool_resident = True

    # ----------------------------------------------------------- start-up

    def register_model(self, model: nn.Module) -> None:
        ropes, orphans = find_layer_ropes(model)
        no_rope = bool(ropes) and all(rope is None for rope in ropes.values())
        if no_rope and type(model).__module__.startswith(
            "vllm.model_executor.models.transformers"
        ):
            # NOTE: vLLM's Transformers modeling backend (e.g. Olmo2 on vLLM
            # 0.32) applies the rope inside transformers' own attention code.
            raise ValueError(
                f"chunk cache cannot find the rotary embedding of attention layer(s) "
                f"{sorted(ropes)[:4]}: the model runs on vLLM's Transformers modeling "
                f"backend ({type(model).__name__}), which applies RoPE inside "
                "transformers' attention code, where keys cannot be re-rotated: "
                "unsupported model implementation"
            )
        if no_rope:
            # NOTE: absolute position embeddings (GPT-2, OPT: every hidden
            # state depends on the position) or an attention bias (ALiBi):
            # moving a segment's keys is exact for neither.
            raise ValueError(
                "chunk cache re-positions a cached segment by rotating its keys with "
                f"RoPE, but attention layer(s) {sorted(ropes)[:4]} have no rotary "
                "embedding: this model places tokens another way (absolute position "
                "embeddings or attention biases such as ALiBi), under which a segment "
                "computed elsewhere cannot be moved: unsupported model"
            )
        if orphans:
            raise ValueError(
                "chunk cache cannot find the rotary embedding of attention "
                f"layer(s) {orphans[:4]}: unsupported model structure"
            )
        rotations: dict[int, RopeRotation] = {}
        for rope in ropes.values():
            if rope is not None and id(rope) not in rotations:
                # Raises ValueError naming the rope type if unsupported.
                rotations[id(rope)] = RopeRotation(rope)
        self._ropes = ropes
        self._rotations = rotations
        self._model = model
        logger.info(
            "Chunk cache: %d attention layers, %d distinct RoPE(s) (%s), %d without",
            len(ropes),
            len(rotations),
            ", ".join(
                sorted({type(r).__name__ for r in ropes.values() if r is not None})
            )
            or "none",
            sum(r is None for r in ropes.values()),
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._ropes is None:
            # The runner never handed us the model (vllm-ascend's NPU runner
            # and vLLM's model runner v2 override initialize_kv_cache without
            # the register_model call): keys would be loaded unrotated.
            raise RuntimeError(
                "chunk cache: the model runner did not call register_model before "
                "register_kv_caches, so cached keys could not be re-rotated; "
                "--enable-chunk-cache needs a model runner that calls "
                "KVConnectorBase_V1.register_model(model)"
            )
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention

        layers = self.vllm_config.compilation_config.static_forward_context
        # NOTE: every attention layer of the forward, not only those with a
        # cache of their own (a KV-sharing layer may have none); the context
        # also holds non-attention layers (fused MoE), which have no keys.
        max_model_len = getattr(self.vllm_config.model_config, "max_model_len", None)
        attention = {
            name: layer
            for name, layer in layers.items()
            if isinstance(layer, (Attention, MLAAttention))
        }
        for name in attention:
            check_attention_layer(name, attention[name], max_model_len)
        from vllm.platforms import current_platform

        one_step_line = check_query_runs(
            RecomputeSteps.for_config(self.vllm_config).one_step,
            attention,
            self.vllm_config.compilation_config,
            current_platform,
            getattr(self.vllm_config, "speculative_config", None),
            self.vllm_config.scheduler_config.max_num_seqs,
        )
        if one_step_line is not None:
            # NOTE: the scheduler's line says which path runs and why; on CUDA
            # this one adds how a step with runs is dispatched and capped.
            logger.info("Chunk cache: boundary recompute on CUDA: %s", one_step_line)
        total = 0
        for name, kv_cache in kv_caches.items():
            layer: Any = layers.get(name)
            check_attention_layer(name, layer, max_model_len)
            if name not in self._ropes:
                raise ValueError(
                    f"chunk cache: attention layer {name} not found in the model"
                )
            # On the paged cache's device (the GPU on CUDA), inside the budget.
            device = cache_device(kv_cache)
            self.device = device
            rope = self._ropes[name]
            rotation = None if rope is None else self._rotations[id(rope)]
            if isinstance(layer, MLAAttention):
                self.latent[name] = LatentLayer.of(
                    name,
                    layer,
                    kv_cache,
                    rotation,
                    _checked(latent_writer_for(layer.impl)),
                    self.num_pool_rows,
                    self.dtype,
                    self._scratch,
                )
                total += self.latent[name].pool.nbytes
                continue
            rows = (self.num_pool_rows, layer.num_kv_heads)
            self.pool_key[name], self.pool_value[name] = (
                torch.zeros(*rows, size, dtype=self.dtype, device=device)
                for size in (layer.head_size, layer.head_size_v)
            )
            total += self.pool_key[name].nbytes + self.pool_value[name].nbytes
            if rotation is not None and rotation.head_size != layer.head_size:
                # NOTE: the delta rotation turns the first rotary_dim values of
                # each key head; a rope built for another width (e.g. k_pe at
                # the end of a wider head) would be turned in the wrong place.
                raise ValueError(
                    f"chunk cache: the rope of attention layer {name} rotates heads of "
                    f"{rotation.head_size} values but its keys have {layer.head_size}: "
                    "unsupported model structure (RoPE on part of a head)"
                )
            self.remappers[name] = PositionRemapper(
                rotation, self._write_rows, self._scratch
            )
        self.pool_bytes = total
        self._layers = {name: layers[name] for name in kv_caches}
        self._kv_caches = dict(kv_caches)
        standard = {name: layers[name] for name in self.remappers}
        standard_caches = {name: kv_caches[name] for name in self.remappers}
        self._capture = choose_capture(
            standard,
            standard_caches,
            {n: _checked(writer_for(layer.impl)) for n, layer in standard.items()},
            self.dtype,
        )
        logger.info("Chunk cache: captures run %s", self._capture.summary())
        check_graph_mode(
            self.vllm_config.compilation_config, self._capture.in_attention
        )
        self._fused = choose_fused_layers(
            standard,
            standard_caches,
            {name: remapper.rotation for name, remapper in self.remappers.items()},
            self.dtype,
            _backend_write,
            self.pool_key,
            self.pool_value,
        )
        # NOTE: their tables of addresses are built at the first load, not
        # here: this runs inside the KV-cache memory pool, which a sleep
        # discards (fused_chunk_load_path.FusedLayers.group).
        self._fused_groups = self._fused.launches
        # NOTE: the fused copy reads the caches the fused load's self-check
        # wrote on, in the pool's dtype (no fp8 group captures here).
        self._capture_groups = [
            launch
            for launch in self._fused_groups
            if not launch.fp8
            and all(n in self._capture.after_forward for n in launch.names)
        ]
        self._allocate_scratch()
        self._start_store()
        logger.info(
            "Chunk cache: loads use %s%s",
            self._fused.summary(),
            f", in {len(self._fused_groups)} launch(es) per step"
            if self._fused_groups
            else "",
        )
        logger.info(
            "Chunk cache pool: %d rows x %d layers, %.1f MiB on %s (%s)",
            self.num_pool_rows,
            len(kv_caches),
            total / (1 << 20),
            self.device,
            self.dtype,
        )
        if self.latent:
            widths = sorted({latent.layout.width for latent in self.latent.values()})
            # NOTE: MLA's latent cache is not split by heads: every TP rank
            # holds (and pools) whole rows.
            logger.info(
                "Chunk cache: %d MLA layer(s), latent rows of %s values (kv_c + k_pe), "
                "replicated on every tensor-parallel rank",
                len(self.latent),
                "/".join(map(str, widths)),
            )
        # NOTE: the CPU path depends on the machine (vLLM's RoPE op is used
        # only where it is bit-identical to the generic rotation): say which.
        for rotation in self._rotations.values():
            logger.info(
                "Chunk cache: keys re-rotated with %s",
                rotation.describe_path(self.device),
            )

    def _start_store(self) -> None:
        if self.vllm_config.chunk_cache_config.chunk_store is None:
            return
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.transfers import (  # noqa: E501
            StoreTransfers,
        )

        tensors = {f"{n}.k": t for n, t in self.pool_key.items()}
        tensors.update({f"{n}.v": t for n, t in self.pool_value.items()})
        tensors.update({f"{n}.latent": lat.pool for n, lat in self.latent.items()})
        assert self._model is not None
        self.store = StoreTransfers.for_engine(
            self.vllm_config,
            self._model,
            tensors,
            f"{self.dtype}/{self.vllm_config.cache_config.cache_dtype}",
        )

    def _allocate_scratch(self) -> None:
        """The load buffers, now, inside the KV cache's memory the carve-out
        counted: K/V ones for standard layers not fused, latent ones for MLA
        layers. Workspace rewritten by every load: a sleep may discard them."""
        per_layer = [name for name in self.remappers if name not in self._fused.layers]
        if per_layer:
            key = self.pool_key[per_layer[0]]
            value = self.pool_value[per_layer[0]]
            self._scratch.prepare(
                RemapScratch.STANDARD,
                {"k": tuple(key.shape[1:]), "v": tuple(value.shape[1:])},
                self.dtype,
                key.device,
            )
        for latent in self.latent.values():
            # Sparse MLA layers add their indexer key's buffers (scratch_plan).
            self._scratch.prepare(
                *latent.scratch_plan(), self.dtype, latent.pool.device
            )
        logger.info(
            "Chunk cache: load buffers of %d rows, %.1f MiB on %s",
            self._scratch.max_rows or 0,
            self._scratch.nbytes() / (1 << 20),
            self.device,
        )

    # --------------------------------------------------------------- load

    def release_pool(self) -> None:
        """The KV cache memory, the pool's included, is released (a sleep or
        discard of vLLM 0.33). The scheduler side forgot every entry in the
        same pause (reset_cache): nothing asks for the rows until a restore."""
        self.pool_resident = False

    def restore_pool(self) -> None:
        """The memory is back, its contents are not: no entry refers to them."""
        self.pool_resident = True

    def start_load_kv(self, meta: Any, forward_context: ForwardContext) -> None:
        self._step_rows = self._step_dst = self._step_key = None
        if meta.store is not None and self.store is not None:
            # NOTE: before the loads: an entry fetched in an earlier step is
            # written into its pool rows here, before a parent reads them.
            self.store.on_step(meta.store)
        if not meta.loads:
            return
        _check_resident(self.pool_resident)
        assert self.device is not None
        # The step's block ids expanded into rows once, on the device.
        expanded = LoadRows.expand(
            meta.loads, POOL_BLOCK_SIZE, self.block_size, self.device
        )
        rows = RemapRows(
            src_rows=expanded.src_rows,
            dst_slots=expanded.dst_slots,
            deltas=expanded.deltas,
            stretch_index=expanded.stretch_index,
            stretch_deltas=expanded.stretch_deltas,
        )
        self._forward_context = forward_context
        try:
            self._load_rows(rows)
        finally:
            self._forward_context = None

    def _load_rows(self, rows: RemapRows) -> None:
        stretches = self._stretch_cos_sin(rows.stretch_deltas)
        self._load_fused(rows, stretches)
        # NOTE: the other layers go through the load buffers, in pieces (more
        # rows than they hold: a load over the per-step cap, run alone).
        for piece in rows.pieces(self._scratch.max_rows or rows.num_rows):
            self._load_piece(piece, stretches)

    def _stretch_cos_sin(
        self, stretch_deltas: torch.Tensor
    ) -> dict[bytes, StretchCosSin]:
        """fp32 cos/sin of each stretch's delta, once per step and set of
        frequencies (an MLA layer's `with_pairing` copy shares its rope's)."""
        fused = self._fused.layers
        rotations = [launch.rotation for launch in self._fused_groups]
        rotations += [r.rotation for n, r in self.remappers.items() if n not in fused]
        rotations += [latent.rotation for latent in self.latent.values()]
        tables: dict[bytes, StretchCosSin] = {}
        for rotation in rotations:
            if rotation is not None and rotation.frequency_key not in tables:
                assert self.device is not None
                tables[rotation.frequency_key] = rotation.stretch_cos_sin(
                    stretch_deltas, self.device
                )
        return tables

    def _load_fused(
        self, rows: RemapRows, stretches: dict[bytes, StretchCosSin]
    ) -> None:
        """The fused layers, one launch per group over all the step's rows."""
        if not self._fused_groups:
            return
        from vllm.v1.worker.fused_chunk_load import fused_load

        for launch in self._fused_groups:
            rotation = launch.rotation
            table = _table(stretches, rotation)
            fused_load(
                launch.group,
                rows.src_rows,
                rows.dst_slots,
                None if rotation is None else rows.stretch_index,
                None if table is None else (table.cos, table.sin),
                rotation is None or rotation.is_neox_style,
                0 if rotation is None else rotation.rotary_dim,
            )

    def _load_piece(
        self, rows: RemapRows, stretches: dict[bytes, StretchCosSin]
    ) -> None:
        """The layers not fused, through the load buffers."""
        for name, remapper in self.remappers.items():
            if name not in self._fused.layers:
                pool_key, pool_value = self.pool_key[name], self.pool_value[name]
                table = _table(stretches, remapper.rotation)
                remapper.remap_layer(name, pool_key, pool_value, rows, table)
        for latent in self.latent.values():
            latent.load(rows, _table(stretches, latent.rotation))

    def _write_rows(
        self,
        layer_name: str,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write K/V rows into the layer's paged cache with the backend's op."""
        forward_context = self._forward_context
        assert forward_context is not None
        layer = forward_context.no_compile_layers[layer_name]
        writer = _checked(writer_for(layer.impl))
        writer.write(layer, key, value, slot_mapping, forward_context)

    # ------------------------------------------------------------ capture

    def capture_after_forward(self, meta: Any) -> None:
        """The rows this step's children computed, from their paged blocks into
        the pool, on every layer not captured by the hook. First, fail the step
        if a hooked layer did not capture (its attention ran outside vLLM's
        wrapper): parents would load its missing rows."""
        if meta.stores:
            _check_resident(self.pool_resident)
        if meta.stores and self._capture.in_attention:
            captured = self._hook_captured if self._hook_step is meta else set()
            self._hook_step, self._hook_captured = None, set()
            missing = set(self._capture.in_attention) - captured
            if missing:
                raise RuntimeError(
                    f"chunk cache: this step computed chunks to cache but attention "
                    f"layer(s) {sorted(missing)[:4]} ({len(missing)} of "
                    f"{len(self._capture.in_attention)}) never reached the capture "
                    "hook (save_kv_layer): their attention ran outside vLLM's "
                    "attention wrapper, so the cached rows would be missing"
                )
        if not meta.stores or (not self._capture.after_forward and not self.latent):
            return
        assert self.device is not None
        rows = StoreRows.expand(
            meta.stores, POOL_BLOCK_SIZE, self.block_size, self.device
        )
        fused: set[str] = set()
        if self._capture_groups:
            from vllm.v1.worker.fused_chunk_load import fused_capture

            for launch in self._capture_groups:
                fused_capture(launch.group, rows.src_slots, rows.dst_rows)
                fused.update(launch.names)
        for name, writer in self._capture.after_forward.items():
            if name in fused:
                continue
            key, value = _checked(writer.read)(
                self._layers[name], self._kv_caches[name], rows.src_slots
            )
            pool_key, pool_value = self.pool_key[name], self.pool_value[name]
            pool_key.index_copy_(0, rows.dst_rows, key.to(pool_key.dtype))
            pool_value.index_copy_(0, rows.dst_rows, value.to(pool_value.dtype))
        for latent in self.latent.values():
            latent.capture(rows.src_slots, rows.dst_rows)

    def save_kv_layer(
        self,
        meta: Any,
        layer_name: str,
        slot_mapping: torch.Tensor | None,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
    ) -> None:
        if not meta.stores or layer_name not in self._capture.in_attention:
            return
        if key is None or value is None or slot_mapping is None:
            raise RuntimeError(
                "chunk cache: save_kv_layer got no key/value (is the "
                "kv_transfer_utils patch applied?)"
            )
        rows, dst = self._step_indices(meta, slot_mapping)
        if self._hook_step is not meta:
            self._hook_step, self._hook_captured = meta, set()
        self._hook_captured.add(layer_name)
        pool_key = self.pool_key[layer_name]
        pool_value = self.pool_value[layer_name]
        pool_key.index_copy_(0, dst, key.index_select(0, rows).to(pool_key.dtype))
        pool_value.index_copy_(0, dst, value.index_select(0, rows).to(pool_value.dtype))

    def _step_indices(
        self, meta: Any, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_capture_indices` once per step (the same for every layer)."""
        step_key = (id(meta), id(slot_mapping))
        if self._step_rows is None or self._step_key != step_key:
            self._step_rows, self._step_dst = self._capture_indices(meta, slot_mapping)
            self._step_key = step_key
        return self._step_rows, self._step_dst

    def _capture_indices(
        self, meta: Any, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch row of each token to capture (found by its paged slot) and its
        pool row, on the batch's device, checked by `assert_on_device`."""
        expanded = StoreRows.expand(
            meta.stores, POOL_BLOCK_SIZE, self.block_size, slot_mapping.device
        )
        wanted, dst = expanded.src_slots, expanded.dst_rows
        slots = slot_mapping.to(torch.int64)
        order = torch.argsort(slots)
        sorted_slots = slots[order]
        pos = torch.searchsorted(sorted_slots, wanted).clamp_(max=slots.numel() - 1)
        rows = order[pos]
        assert_on_device(
            (slots[rows] == wanted).all(),
            "chunk cache: some child tokens to capture are not in this step's "
            "batch (scheduler/worker disagree)",
        )
        return rows, dst


def assert_on_device(ok: torch.Tensor, message: str) -> None:
    """Raise `message` unless the one-element bool tensor `ok` holds.

    CPU and CUDA: `torch._assert_async`, with no host synchronisation (which
    would serialise host and device under async scheduling). Elsewhere
    (vllm-ascend's NPU, where that op has no kernel) the flag is read on the
    host: one synchronisation per step that captures in the hook."""
    from vllm.platforms import current_platform

    if getattr(current_platform, "device_type", None) in ("cpu", "cuda"):
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise RuntimeError(message)
