# SPDX-License-Identifier: Apache-2.0
"""Where each layer's capture runs, decided at start-up (issue 21).

A child's K/V rows are what the attention backend wrote into the child's
paged blocks. Where the cache holds them as written (the model dtype, a
layout the backend's registered reader knows), the capture copies them from
those blocks into the pool **after the forward** (`wait_for_save`): nothing
of the chunk cache runs inside the model, so full CUDA graphs stay on and
there is no per-layer work in the forward. The blocks are still the child's
then: vLLM frees them only when the step's output is processed, and any
later write into them is a later step, after this one in stream order.

Elsewhere (a quantized cache, whose bytes are not the rows; a CPU ISA that
packs K for its matrix unit) the capture stays **in the attention hook**
(`save_kv_layer`, patch 0004), which sees the rows before the cache write;
that needs attention outside any captured graph (support.check_graph_mode).

Which one is decided per layer by a self-check, like the fused load's: a
sample of random rows is written through the backend's own write into
blocks no request holds yet (block 1 on), read back with the reader, and
must come back bit for bit; the cache is restored. The start-up log says
which path each layer took and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
    CacheWriter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    UNQUANTIZED_KV_CACHE_DTYPES,
)

_SAMPLE_ROWS = 48


@dataclass
class CaptureChoice:
    """Per standard-attention layer: read back after the forward, or the hook."""

    # layer name -> its writer (whose `read` the capture uses).
    after_forward: dict[str, CacheWriter] = field(default_factory=dict)
    # layer name -> why its capture stays in the attention hook.
    in_attention: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.in_attention:
            return (f"after the forward from the child's paged blocks on all "
                    f"{len(self.after_forward)} layer(s)")
        why = "; ".join(sorted(set(self.in_attention.values()))[:3])
        head = (f"after the forward on {len(self.after_forward)} layer(s), "
                if self.after_forward else "")
        return f"{head}in the attention hook on {len(self.in_attention)} layer(s): {why}"


def self_check(layer: Any, kv_cache: Any, writer: CacheWriter,
               dtype: torch.dtype) -> str | None:
    """None if rows written through `writer.write` come back bit for bit
    through `writer.read`; else why not. Leaves `kv_cache` as it was."""
    if writer.read is None:
        return f"{writer.backend}'s cache has no reader"
    cache_dtype = str(getattr(layer.impl, "kv_cache_dtype", "auto"))
    if cache_dtype not in UNQUANTIZED_KV_CACHE_DTYPES:
        return f"quantized KV cache ({cache_dtype}): its bytes are not the rows"
    if not isinstance(kv_cache, torch.Tensor) or getattr(layer, "kv_cache", None) is not kv_cache:
        # NOTE: the backend's write goes to the layer's bound cache; only a
        # check on the very tensor the reader reads proves anything.
        return "the layer's bound cache is not the registered one"
    # [blocks, heads, block_size, 2 * head] on the CPU, [blocks, 2,
    # block_size, heads, head] in the flash layouts.
    block_size = kv_cache.shape[2]
    rows = min(_SAMPLE_ROWS, (kv_cache.shape[0] - 1) * block_size)
    if rows <= 0:
        return "no free block for the self-check"
    touched = slice(1, 1 + -(-rows // block_size))
    gen = torch.Generator().manual_seed(1)
    device = kv_cache.device
    key = (4 * torch.randn((rows, layer.num_kv_heads, layer.head_size), generator=gen))
    value = (4 * torch.randn((rows, layer.num_kv_heads, layer.head_size_v), generator=gen))
    key, value = key.to(dtype).to(device), value.to(dtype).to(device)
    slots = torch.arange(block_size, block_size + rows, device=device)
    saved = kv_cache[touched].clone()
    try:
        writer.write(layer, key, value, slots, None)
        got_key, got_value = writer.read(layer, kv_cache, slots)
        differ = _bytes_differ(got_key, key) + _bytes_differ(got_value, value)
    except Exception as e:  # noqa: BLE001 - any failure keeps the hook
        return f"self-check failed ({type(e).__name__}: {e})"
    finally:
        kv_cache[touched] = saved
    if differ:
        return (f"self-check: {differ} of {2 * key.numel() * key.element_size()} bytes "
                f"read back differ ({writer.backend} packs this cache)")
    return None


def _bytes_differ(got: torch.Tensor, want: torch.Tensor) -> int:
    if got.shape != want.shape or got.dtype != want.dtype:
        return want.numel() * want.element_size()
    return int((got.contiguous().view(torch.uint8) != want.view(torch.uint8)).sum())


def choose_capture(layers: dict[str, Any], kv_caches: dict[str, Any],
                   writers: dict[str, CacheWriter], dtype: torch.dtype) -> CaptureChoice:
    """Per layer: after the forward where self-checked, else the hook, and why."""
    choice = CaptureChoice()
    for name, kv_cache in kv_caches.items():
        reason = self_check(layers[name], kv_cache, writers[name], dtype)
        if reason is None:
            choice.after_forward[name] = writers[name]
        else:
            choice.in_attention[name] = reason
    return choice
