# SPDX-License-Identifier: Apache-2.0
"""Which layers load through the fused Triton kernel (issue 21), decided at start-up.

On a GPU the fused kernel (`vllm/v1/worker/fused_chunk_load.py`) replaces a
layer's gather + rotation + backend cache write only where a start-up
self-check finds it writes **the same bytes** as that path, on the layer's own
paged cache, dtype, layout and k/v scales: a sample of rows is written both
ways into blocks no request holds yet (block 1 on; the cache is restored after).
Anything else (the CPU, whose backend packs its cache per ISA; a backend or
KV-cache dtype the kernel does not know; a difference in one byte; an error)
keeps today's path, and the start-up log says which and why. So a fused load
is never a different answer, only a faster one.

NOTE: written and tested on the CPU (the self-check's logic, with Triton's
interpreter); not executed on a GPU here (docs/gpu.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    UNQUANTIZED_KV_CACHE_DTYPES,
)
from vllm.v1.worker.position_remapper import RopeRotation

# Backends whose paged cache is [num_blocks, 2, block_size, heads, head] (NHD,
# or HND through its strides) and whose write is reshape_and_cache_flash's
# arithmetic (the self-check still decides).
_FUSED_BACKENDS = ("FlashAttentionImpl", "FlashInferImpl", "TritonAttentionImpl")
# KV-cache dtypes the kernel writes: the model's own, or fp8 e4m3.
_FP8 = ("fp8", "fp8_e4m3")
_SAMPLE_ROWS = 48

# (layer, key rows, value rows, kv_cache, slots) -> None: the backend's write
# into the given cache (the layer's `impl.do_kv_cache_update` on a GPU).
ReferenceWrite = Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class FusedLoadChoice:
    """The layers that load through the fused kernel, and why the others do not."""

    # layer name -> its paged caches as the kernel writes them.
    layers: dict[str, Any] = field(default_factory=dict)
    # layer name -> why it keeps today's path (start-up log).
    reasons: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.reasons and not self.layers:
            return "no standard attention layer (nothing for the fused kernel)"
        if not self.reasons:
            return (f"the fused Triton load kernel on all {len(self.layers)} layers "
                    "(self-check: bytes identical to the backend's cache write)")
        why = sorted(set(self.reasons.values()))
        head = (f"the fused Triton load kernel on {len(self.layers)} layer(s), "
                if self.layers else "")
        return (f"{head}gather + rotation + the backend's cache write on "
                f"{len(self.reasons)} layer(s): " + "; ".join(why[:3]))


@dataclass(frozen=True)
class FusedLayers:
    """Layers loaded by one launch of the fused kernel, and their RoPE."""

    names: tuple[str, ...]
    group: Any  # fused_chunk_load.FusedGroup
    rotation: RopeRotation | None


def group_fused_layers(
    choice: FusedLoadChoice,
    pool_key: dict[str, torch.Tensor],
    pool_value: dict[str, torch.Tensor],
    rotations: dict[str, RopeRotation | None],
) -> list[FusedLayers]:
    """The fused layers in as few launches as they allow: one per RoPE and
    shape (strides, dtypes) of pool and cache; for a usual model, one."""
    from vllm.v1.worker.fused_chunk_load import FusedGroup

    buckets: dict[tuple, list[str]] = {}
    for name, paged in choice.layers.items():
        key, cache = pool_key[name], paged.key_cache
        bucket = (id(rotations[name]), tuple(key.shape[1:]), key.stride(), key.dtype,
                  tuple(cache.shape), cache.stride(), cache.dtype,
                  None if paged.k_scale is None else paged.k_scale.numel())
        buckets.setdefault(bucket, []).append(name)
    return [
        FusedLayers(tuple(names),
                    FusedGroup.of([pool_key[n] for n in names], [pool_value[n] for n in names],
                                  [choice.layers[n] for n in names]),
                    rotations[names[0]])
        for names in buckets.values()
    ]


def paged_layer(layer: Any, kv_cache: torch.Tensor):
    """The kernel's view of a layer's cache, or a reason string it has none."""
    from vllm.v1.worker.fused_chunk_load import PagedLayer

    impl = getattr(layer, "impl", None)
    name = type(impl).__name__
    if name not in _FUSED_BACKENDS:
        return f"backend {name} has no fused load"
    if getattr(impl, "_is_per_token_head_quant", False):
        return "per-token-head quantized KV cache"
    if layer.head_size_v != layer.head_size:
        return "K and V head sizes differ"
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        return f"unexpected paged cache shape {tuple(kv_cache.shape)}"
    dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    key_cache, value_cache = kv_cache.unbind(1)
    if dtype in _FP8:
        key_cache = key_cache.view(torch.float8_e4m3fn)
        value_cache = value_cache.view(torch.float8_e4m3fn)
        return PagedLayer(key_cache, value_cache, layer._k_scale, layer._v_scale)
    if dtype not in UNQUANTIZED_KV_CACHE_DTYPES:
        return f"KV-cache dtype {dtype}"
    return PagedLayer(key_cache, value_cache)


def self_check(
    layer: Any,
    kv_cache: torch.Tensor,
    paged: Any,
    rotation: RopeRotation | None,
    pool_dtype: torch.dtype,
    reference_write: ReferenceWrite,
) -> str | None:
    """None if the fused kernel writes the bytes today's path writes on a
    sample of rows (random K/V, deltas of both signs up to 40,000, every
    row's slot in blocks 1..); else why not. Leaves `kv_cache` as it was."""
    from vllm.v1.worker.fused_chunk_load import FusedGroup, fused_load

    device = kv_cache.device
    num_blocks, _, block_size = kv_cache.shape[:3]
    rows = min(_SAMPLE_ROWS, (num_blocks - 1) * block_size)
    if rows <= 0:
        return "no free block for the self-check"
    touched = slice(1, 1 + -(-rows // block_size))
    gen = torch.Generator().manual_seed(0)
    shape = (rows, layer.num_kv_heads, layer.head_size)
    key = (4 * torch.randn(shape, generator=gen)).to(pool_dtype).to(device)
    value = (4 * torch.randn(shape, generator=gen)).to(pool_dtype).to(device)
    deltas = torch.tensor([0, 3, -700, 2900, 40000, -1]).repeat(rows)[:rows].to(device)
    slots = torch.arange(block_size, block_size + rows, device=device)
    saved = kv_cache[touched].clone()
    try:
        moved = key
        cos_sin = None
        if rotation is not None:
            cos_sin = rotation.cos_sin_rows(deltas)
            moved = rotation.rotate(key.float(), deltas, cos_sin).to(pool_dtype)
        reference_write(layer, moved, value, kv_cache, slots)
        want = kv_cache[touched].clone()
        kv_cache[touched] = saved
        fused_load(
            FusedGroup.of([key], [value], [paged]), torch.arange(rows, device=device), slots,
            None if rotation is None else torch.arange(rows, device=device),
            cos_sin, rotation is None or rotation.is_neox_style,
            rotation.rotary_dim if rotation is not None else layer.head_size)
        got = kv_cache[touched].clone()
    except Exception as e:  # noqa: BLE001 - any failure keeps today's path
        return f"self-check failed ({type(e).__name__}: {e})"
    finally:
        kv_cache[touched] = saved
    differ = int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
    if differ:
        return f"self-check: {differ} of {want.numel() * want.element_size()} bytes differ"
    return None


def choose_fused_layers(
    layers: dict[str, Any],
    kv_caches: dict[str, torch.Tensor],
    rotations: dict[str, RopeRotation | None],
    pool_dtype: torch.dtype,
    reference_write: ReferenceWrite,
) -> FusedLoadChoice:
    """Per layer: the fused kernel where available and self-checked, else why not."""
    choice = FusedLoadChoice()
    for name, kv_cache in kv_caches.items():
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.device.type == "cpu":
            # NOTE: the CPU backend packs its cache per ISA: its own op writes.
            choice.reasons[name] = "the CPU backend's own cache write"
            continue
        from vllm.v1.worker import fused_chunk_load

        if not fused_chunk_load.available():
            choice.reasons[name] = "Triton is not installed"
            continue
        paged = paged_layer(layers[name], kv_cache)
        if isinstance(paged, str):
            choice.reasons[name] = paged
            continue
        reason = self_check(layers[name], kv_cache, paged, rotations[name], pool_dtype,
                            reference_write)
        if reason is None:
            choice.layers[name] = paged
        else:
            choice.reasons[name] = reason
    return choice
