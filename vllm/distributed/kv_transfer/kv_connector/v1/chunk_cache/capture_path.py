# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where each layer's capture runs, decided at start-up.

Where the paged cache holds a child's K/V rows as written (the model dtype, a
layout the backend's reader knows), the capture copies them from the child's
blocks into the pool **after the forward** (`wait_for_save`; vLLM frees the
blocks only when the step's output is processed), and full CUDA graphs stay
on. Elsewhere (a quantized cache; a CPU ISA that packs K) it stays **in the
attention hook** (`save_kv_layer`), outside any captured graph
(support.check_graph_mode). Decided per layer by a self-check on
sample_check.py's harness; `capture_hook_reason` guesses it from the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
    CacheWriter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.sample_check import (
    bytes_differ,
    choice_summary,
    random_rows,
    restored,
    sample_rows,
    sample_slots,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    UNQUANTIZED_KV_CACHE_DTYPES,
)


@dataclass
class CaptureChoice:
    """Per standard-attention layer: read back after the forward, or the hook."""

    # layer name -> its writer (the capture uses its `read`).
    after_forward: dict[str, CacheWriter] = field(default_factory=dict)
    # layer name -> why its capture stays in the attention hook.
    in_attention: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        return choice_summary(
            "after the forward from the child's paged blocks",
            len(self.after_forward),
            "in the attention hook",
            self.in_attention,
        )


def quantized_reason(cache_dtype: str) -> str | None:
    """Why a cache of --kv-cache-dtype `cache_dtype` captures in the hook
    (its bytes are not the rows), or None."""
    if str(cache_dtype) not in UNQUANTIZED_KV_CACHE_DTYPES:
        return f"quantized KV cache ({cache_dtype}): its bytes are not the rows"
    return None


def capture_hook_reason(vllm_config: Any) -> str | None:
    """Why some layer may capture in the attention hook, as far as the config
    tells before any layer exists (the CUDA-graph mode is chosen from it), or
    None. `choose_capture` decides per layer later, by the same rule."""
    from vllm.platforms import current_platform

    device_type = getattr(current_platform, "device_type", "cpu")
    if device_type not in ("cuda", "cpu"):
        return (
            f"the {device_type} platform's standard attention has no cache reader, "
            "so its captures run in the attention hook"
        )
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if quantized_reason(cache_dtype) is not None:
        return (
            f"the capture of a quantized cache (--kv-cache-dtype {cache_dtype}) "
            "runs in the attention hook"
        )
    return None


def self_check(
    layer: Any, kv_cache: Any, writer: CacheWriter, dtype: torch.dtype
) -> str | None:
    """None if rows written through `writer.write` come back bit for bit
    through `writer.read`; else why not. Leaves `kv_cache` as it was."""
    read = writer.read
    if read is None:
        return f"{writer.backend}'s cache has no reader"
    reason = quantized_reason(getattr(layer.impl, "kv_cache_dtype", "auto"))
    if reason is not None:
        return reason
    if (
        not isinstance(kv_cache, torch.Tensor)
        or getattr(layer, "kv_cache", None) is not kv_cache
    ):
        # NOTE: the backend's write goes to the layer's bound cache; only a
        # check on the very tensor the reader reads proves anything.
        return "the layer's bound cache is not the registered one"
    # [blocks, heads, block_size, 2 * head] on the CPU, [blocks, 2,
    # block_size, heads, head] in the flash layouts.
    rows = sample_rows(kv_cache)
    if rows <= 0:
        return "no free block for the self-check"
    heads, device = layer.num_kv_heads, kv_cache.device
    key = random_rows((rows, heads, layer.head_size), dtype, device, seed=1)
    value = random_rows((rows, heads, layer.head_size_v), dtype, device, seed=2)
    slots = sample_slots(kv_cache, rows)
    try:
        with restored([kv_cache], rows):
            writer.write(layer, key, value, slots, None)
            got_key, got_value = read(layer, kv_cache, slots)
            differ = bytes_differ(got_key, key) + bytes_differ(got_value, value)
    except Exception as e:  # noqa: BLE001 - any failure keeps the hook
        return f"self-check failed ({type(e).__name__}: {e})"
    if differ:
        return (
            f"self-check: {differ} of {2 * key.numel() * key.element_size()} bytes "
            f"read back differ ({writer.backend} packs this cache)"
        )
    return None


def choose_capture(
    layers: dict[str, Any],
    kv_caches: dict[str, Any],
    writers: dict[str, CacheWriter],
    dtype: torch.dtype,
) -> CaptureChoice:
    """Per layer: after the forward where self-checked, else the hook, and why."""
    choice = CaptureChoice()
    for name, kv_cache in kv_caches.items():
        reason = self_check(layers[name], kv_cache, writers[name], dtype)
        if reason is None:
            choice.after_forward[name] = writers[name]
        else:
            choice.in_attention[name] = reason
    return choice
