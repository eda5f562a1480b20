# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Writing K/V rows into a layer's paged KV cache, per attention backend.

The load path never indexes a paged cache by hand: each backend's own
cache-write op packs, lays out and quantizes the rows as for fresh tokens.
This module maps an attention implementation class to that op (a platform
plugin registers its own); a layer without one is refused at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

# (layer, key rows, value rows, paged slot per row, the step's forward context
# or None at start-up) -> None
WriteFn = Callable[
    [Any, torch.Tensor, torch.Tensor, torch.Tensor, "ForwardContext | None"], None
]
# (layer, the layer's paged cache, paged slot per row [n]) -> (key rows
# [n, num_kv_heads, head_size], value rows [n, num_kv_heads, head_size_v]).
ReadFn = Callable[[Any, Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class CacheWriter:
    """How the chunk cache writes rows for one attention implementation."""

    # The backend's name as users select it (--attention-backend), for messages.
    backend: str
    # Writes the rows through the backend's own cache-write op.
    write: WriteFn
    # Reads rows back for the capture after the forward (capture_path.py);
    # None where the layout is not plain: the capture takes the attention hook.
    read: ReadFn | None = None


# Attention implementation class name -> its writer.
_WRITERS: dict[str, CacheWriter] = {}


def register_cache_writer(
    impl_class_name: str, backend: str, write: WriteFn, read: ReadFn | None = None
) -> None:
    _WRITERS[impl_class_name] = CacheWriter(backend, write, read)


def writer_for(impl: Any) -> CacheWriter | None:
    return _WRITERS.get(type(impl).__name__)


def supported_backends() -> list[str]:
    return sorted({w.backend for w in _WRITERS.values()})


def _write_via_kv_cache_update(layer, key, value, slots, forward_context) -> None:
    # FlashAttention / FlashInfer / Triton: reshape_and_cache_flash (or the
    # backend's own variant), quantizing with the layer's k/v scale for fp8.
    layer.impl.do_kv_cache_update(layer, key, value, layer.kv_cache, slots)


def _write_cpu(layer, key, value, slot_mapping, forward_context) -> None:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    kv_cache = layer.kv_cache
    num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
    paged = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))
    key_cache, value_cache = paged.chunk(2, dim=2)
    isa = _step_isa(forward_context, layer.layer_name) or _get_attn_isa(
        key.dtype, block_size, layer.head_size, layer.impl.kv_cache_dtype
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
        kv_cache_dtype=layer.impl.kv_cache_dtype,
    )


def _step_isa(forward_context: ForwardContext | None, layer_name: str) -> str | None:
    """The ISA the CPU backend chose for this step (it packs the cache per ISA)."""
    if forward_context is None:  # the start-up self-check: no step yet
        return None
    by_layer = forward_context.attn_metadata
    if isinstance(by_layer, list):  # one per micro-batch
        by_layer = by_layer[0] if by_layer else {}
    metadata = by_layer.get(layer_name) if isinstance(by_layer, dict) else None
    return getattr(metadata, "isa", None)


def _read_flash(layer, kv_cache, slots) -> tuple[torch.Tensor, torch.Tensor]:
    # [num_blocks, 2, block_size, heads, head] (FlashAttention, FlashInfer and
    # Triton; NHD, or HND through its strides): a copy of the rows written.
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    return kv_cache[:, 0][blocks, offsets], kv_cache[:, 1][blocks, offsets]


def _read_cpu(layer, kv_cache, slots) -> tuple[torch.Tensor, torch.Tensor]:
    # NOTE: the CPU backend's "vec" and "vec16" layout (csrc/cpu/cpu_attn_vec*):
    # per block and head, K as [head_size, block_size], then V as [block_size,
    # head_size]. Other ISAs pack differently: capture_path's self-check.
    num_blocks, num_heads, block_size, _ = kv_cache.shape
    head_size = layer.head_size
    paged = kv_cache.view(num_blocks, num_heads, 2, block_size * head_size)
    keys = paged[:, :, 0].view(num_blocks, num_heads, head_size, block_size)
    values = paged[:, :, 1].view(num_blocks, num_heads, block_size, head_size)
    blocks, offsets = slots // block_size, slots % block_size
    keys = keys.permute(0, 3, 1, 2)[blocks, offsets]
    return keys, values.transpose(1, 2)[blocks, offsets]


# MLA: (layer, kv_c [n, kv_lora_rank], k_pe [n, rope_dim], slots, the layer's
# latent cache) -> None, through the backend's own latent cache write.
LatentWriteFn = Callable[
    [Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]


@dataclass(frozen=True)
class LatentWriter:
    """How the chunk cache writes MLA latent rows for one implementation, and
    reads a child's rows back from its latent cache (the capture)."""

    backend: str
    write: LatentWriteFn
    # (latent cache, slots [n]) -> rows [n, kv_lora_rank + rope_dim].
    read: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # The pairing of k_pe in the rows `read` returns and `write` takes where
    # the backend fixes it whatever the rope's style (True: halves, False:
    # adjacent values, as vllm-ascend's MLA); None: the rope's.
    k_pe_neox_style: bool | None = None
    # (layer name, layer) -> None, or ValueError naming what this writer cannot
    # serve on that layer once the model is loaded (support.check_attention_layer).
    check_layer: Callable[[str, Any], None] | None = None
    # The platform (vLLM's `device_type`) whose users pick this backend with
    # --attention-backend: a refused MLA backend's message suggests it there.
    # None: picked by its platform itself (vllm-ascend), never suggested.
    device_type: str | None = None


_LATENT_WRITERS: dict[str, LatentWriter] = {}


def register_latent_writer(
    impl_class_name: str,
    backend: str,
    write: LatentWriteFn,
    read: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    k_pe_neox_style: bool | None = None,
    check_layer: Callable[[str, Any], None] | None = None,
    device_type: str | None = None,
) -> None:
    _LATENT_WRITERS[impl_class_name] = LatentWriter(
        backend, write, read, k_pe_neox_style, check_layer, device_type
    )


def latent_writer_for(impl: Any) -> LatentWriter | None:
    return _LATENT_WRITERS.get(type(impl).__name__)


def supported_latent_backends(device_type: str | None = None) -> list[str]:
    """Every registered MLA backend, or those a user of `device_type` picks by name."""
    return sorted(
        {
            w.backend
            for w in _LATENT_WRITERS.values()
            if device_type is None or w.device_type == device_type
        }
    )


def _write_latent_via_kv_cache_update(layer, kv_c, k_pe, slots, kv_cache) -> None:
    # The call the MLA layer itself makes (unified_mla_kv_cache_update), k_pe
    # as [n, 1, rope_dim]: CPU_MLA indexes its cache, the CUDA impls below
    # inherit MLAAttentionImpl's (concat_and_cache_mla).
    layer.impl.do_kv_cache_update(
        kv_c_normed=kv_c,
        k_pe=k_pe.unsqueeze(1),
        kv_cache=kv_cache,
        slot_mapping=slots,
        kv_cache_dtype=layer.kv_cache_dtype,
        k_scale=layer._k_scale,
    )


def _read_plain_latent(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # Only a cache in the model dtype ("auto"; support.py refuses the rest)
    # holds the rows as written.
    return kv_cache.view(-1, kv_cache.shape[-1]).index_select(0, slots)


# MLA backends whose latent cache is a plain [blocks, block_size, rank +
# rope_dim] tensor written by the inherited do_kv_cache_update: vLLM 0.32's
# CPU_MLA (executed in CI); on CUDA, TRITON_MLA, FLASH_ATTN_MLA and FLASHMLA,
# never executed on a GPU (docs/design/mla.md). Every other MLA backend is
# refused at start-up: FLASHINFER_MLA, CUTLASS_MLA, TOKENSPEED_MLA, ROCm's,
# sparse MLA's and Ascend's (its plugin registers its own), and AMX_MLA, whose
# cache write was never run on an AMX machine (the refusal names CPU_MLA).
for impl_name, backend, device_type in (
    ("CPUMLAImpl", "CPU_MLA", "cpu"),
    ("TritonMLAImpl", "TRITON_MLA", "cuda"),
    ("FlashAttnMLAImpl", "FLASH_ATTN_MLA", "cuda"),
    ("FlashMLAImpl", "FLASHMLA", "cuda"),
):
    register_latent_writer(
        impl_name,
        backend,
        _write_latent_via_kv_cache_update,
        _read_plain_latent,
        device_type=device_type,
    )

# vLLM 0.23.0 picks, for standard attention on CUDA: FLASH_ATTN, FLASHINFER,
# TRITON_ATTN, then FLEX_ATTENTION (FlashInfer first on Blackwell); on CPU:
# CPU_ATTN. FLEX_ATTENTION (and ROCm, MLA) are not registered: refused.
for impl_name, backend in (
    ("FlashAttentionImpl", "FLASH_ATTN"),
    ("FlashInferImpl", "FLASHINFER"),
    ("TritonAttentionImpl", "TRITON_ATTN"),
):
    register_cache_writer(impl_name, backend, _write_via_kv_cache_update, _read_flash)
register_cache_writer("CPUAttentionBackendImpl", "CPU_ATTN", _write_cpu, _read_cpu)
