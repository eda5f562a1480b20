# SPDX-License-Identifier: Apache-2.0
"""Worker side of the chunk cache: the pool tensors, capture and load.

* The chunk pool is a separate per-layer store in worker memory:
  key [rows, num_kv_heads, head_size] and value [rows, num_kv_heads,
  head_size_v] in the model dtype (not vLLM's paged, ISA-packed cache).
* Capture (`save_kv_layer`): while a child request runs, its post-RoPE K
  and raw V rows (handed over by the patched attention wrapper) are copied
  into the pool rows the scheduler assigned. The child's rows are found in
  the batch by their paged slots, which the scheduler knows.
* Load (`start_load_kv`, before the forward): the `PositionRemapper`
  gathers the rows, rotates K by the position delta with the layer's own
  rotary embedding, and writes K/V into the parent's paged blocks through
  the attention backend's own cache-write op (on CPU:
  `ops.cpu_attn_reshape_and_cache`, which packs per ISA).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
    POOL_BLOCK_SIZE,
    pool_num_blocks,
)
from vllm.logger import init_logger
from vllm.v1.worker.position_remapper import (
    PositionRemapper,
    RemapRows,
    RopeRotation,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)


def find_layer_ropes(model: nn.Module) -> tuple[dict[str, nn.Module | None], list[str]]:
    """Attention layer name -> its rotary embedding (None: the model has no
    RoPE at all); plus the names of attention layers whose rope could not
    be found although the model uses RoPE.

    The rope is the `rotary_emb` of the module that owns the attention
    layer (the convention of vLLM's decoder models).
    """
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    ropes: dict[str, nn.Module | None] = {}
    orphans: list[str] = []
    any_rope = False
    for _, module in model.named_modules():
        if isinstance(module, MLAAttention):
            raise ValueError(
                f"chunk cache does not support MLA attention ({module.layer_name}): "
                "its latent KV cannot be re-positioned by a RoPE rotation"
            )
        rope = getattr(module, "rotary_emb", None)
        if isinstance(rope, nn.Module):
            any_rope = True
        for child in module.children():
            if isinstance(child, Attention):
                ropes[child.layer_name] = rope if isinstance(rope, nn.Module) else None
    if any_rope:
        orphans = [name for name, rope in ropes.items() if rope is None]
    return ropes, orphans


class ChunkCacheWorker:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        self.vllm_config = vllm_config
        self.num_pool_rows = pool_num_blocks(vllm_config, kv_cache_config) * POOL_BLOCK_SIZE
        self.dtype = vllm_config.model_config.dtype
        self.pool_key: dict[str, torch.Tensor] = {}
        self.pool_value: dict[str, torch.Tensor] = {}
        self.remappers: dict[str, PositionRemapper] = {}
        self._ropes: dict[str, nn.Module | None] | None = None
        # Batch rows of this step's captured child tokens (same for every
        # layer of the single KV cache group), computed on the first layer.
        self._step_rows: torch.Tensor | None = None
        self._step_key: int | None = None

    # ----------------------------------------------------------- start-up

    def register_model(self, model: nn.Module) -> None:
        ropes, orphans = find_layer_ropes(model)
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
        logger.info(
            "Chunk cache: %d attention layers, %d distinct RoPE(s) (%s)",
            len(ropes),
            len(rotations),
            ", ".join(sorted({type(r).__name__ for r in ropes.values() if r is not None}))
            or "none",
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.layers.attention.attention import Attention

        layers = self.vllm_config.compilation_config.static_forward_context
        total = 0
        for name in kv_caches:
            layer = layers.get(name)
            if not isinstance(layer, Attention):
                raise ValueError(
                    f"chunk cache supports standard attention layers only; "
                    f"{name} is {type(layer).__name__}"
                )
            shape_k = (self.num_pool_rows, layer.num_kv_heads, layer.head_size)
            shape_v = (self.num_pool_rows, layer.num_kv_heads, layer.head_size_v)
            self.pool_key[name] = torch.zeros(shape_k, dtype=self.dtype)
            self.pool_value[name] = torch.zeros(shape_v, dtype=self.dtype)
            total += self.pool_key[name].nbytes + self.pool_value[name].nbytes
            rope = None if self._ropes is None else self._ropes.get(name)
            rotation = None if rope is None else self._rotations[id(rope)]
            if self._ropes is None:
                logger.warning("chunk cache: no model registered; keys are not rotated")
            self.remappers[name] = PositionRemapper(rotation, self._write_rows)
        logger.info(
            "Chunk cache pool: %d rows x %d layers, %.1f MiB",
            self.num_pool_rows,
            len(kv_caches),
            total / (1 << 20),
        )

    # --------------------------------------------------------------- load

    def start_load_kv(self, meta: Any, forward_context: ForwardContext) -> None:
        self._step_rows = None
        self._step_key = None
        if not meta.load_src_rows:
            return
        self._forward_context = forward_context
        device = next(iter(self.pool_key.values())).device
        rows = RemapRows(
            src_rows=torch.tensor(meta.load_src_rows, dtype=torch.int64, device=device),
            dst_slots=torch.tensor(meta.load_dst_slots, dtype=torch.int64, device=device),
            deltas=torch.tensor(meta.load_deltas, dtype=torch.int64),
        )
        for name, remapper in self.remappers.items():
            remapper.remap_layer(name, self.pool_key[name], self.pool_value[name], rows)
        self._forward_context = None

    def _write_rows(
        self,
        layer_name: str,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write K/V rows into the layer's paged cache with the backend's op."""
        forward_context = self._forward_context
        layer = forward_context.no_compile_layers[layer_name]
        kv_cache = layer.kv_cache
        impl = layer.impl
        if hasattr(impl, "do_kv_cache_update"):
            impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            return
        from vllm.v1.attention.backends.cpu_attn import (
            CPUAttentionBackendImpl,
            _get_attn_isa,
        )

        if not isinstance(impl, CPUAttentionBackendImpl):
            raise NotImplementedError(
                f"chunk cache: no cache-write op known for {type(impl).__name__}"
            )
        from vllm import _custom_ops as ops

        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        paged = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))
        key_cache, value_cache = paged.chunk(2, dim=2)
        isa = self._isa(forward_context, layer_name)
        if isa is None:
            isa = _get_attn_isa(
                self.dtype,
                block_size,
                layer.head_size,
                self.vllm_config.cache_config.cache_dtype,
            )
        ops.cpu_attn_reshape_and_cache(
            key.contiguous(),
            value.contiguous(),
            key_cache,
            value_cache,
            slot_mapping,
            isa,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=impl.kv_cache_dtype,
        )

    @staticmethod
    def _isa(forward_context: ForwardContext, layer_name: str) -> str | None:
        metadata = forward_context.attn_metadata
        if isinstance(metadata, list):
            metadata = metadata[0] if metadata else None
        if isinstance(metadata, dict):
            metadata = metadata.get(layer_name)
        return getattr(metadata, "isa", None)

    # ------------------------------------------------------------ capture

    def save_kv_layer(
        self,
        meta: Any,
        layer_name: str,
        slot_mapping: torch.Tensor | None,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
    ) -> None:
        if not meta.store_src_slots or layer_name not in self.pool_key:
            return
        if key is None or value is None or slot_mapping is None:
            raise RuntimeError(
                "chunk cache: save_kv_layer got no key/value (is the "
                "kv_transfer_utils patch applied?)"
            )
        if self._step_rows is None or self._step_key != id(slot_mapping):
            self._step_rows = self._batch_rows(meta, slot_mapping)
            self._step_key = id(slot_mapping)
        rows = self._step_rows
        dst = torch.as_tensor(meta.store_dst_rows, dtype=torch.int64)
        self.pool_key[layer_name][dst] = key.index_select(0, rows).to(self.dtype)
        self.pool_value[layer_name][dst] = value.index_select(0, rows).to(self.dtype)

    @staticmethod
    def _batch_rows(meta: Any, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Index in the batch of each token to capture, found by its slot."""
        wanted = torch.as_tensor(meta.store_src_slots, dtype=torch.int64)
        slots = slot_mapping.to(torch.int64)
        order = torch.argsort(slots)
        sorted_slots = slots[order]
        pos = torch.searchsorted(sorted_slots, wanted).clamp_(max=slots.numel() - 1)
        rows = order[pos]
        if not bool((slots[rows] == wanted).all()):
            raise RuntimeError(
                "chunk cache: some child tokens to capture are not in this "
                "step's batch (scheduler/worker disagree)"
            )
        return rows
