# SPDX-License-Identifier: Apache-2.0
"""NPU side of the fork's chunk cache (vllm-ascend overlay module).

The chunk cache itself is device-generic (the fork's vLLM:
vllm/distributed/kv_transfer/kv_connector/v1/chunk_cache/): the pool lives
on the device of each layer's paged KV cache, inside the KV budget (the
budget is carved in vLLM's EngineCore, which vllm-ascend uses as is), K is
re-rotated in fp32 torch ops (no NPU fused rotary op: the torch path is the
only one, so there is nothing to check it against), and rows are written
through the attention backend's own cache-write op. This module adds that
op for Ascend's standard attention (`AscendAttentionBackendImpl`): Ascend
keeps separate key and value caches [num_blocks, block_size, num_kv_heads,
head_size] and writes them with `DeviceOperator.reshape_and_cache`
(`torch_npu._npu_reshape_and_cache` on A2/A3, `npu_scatter_pa_kv_cache` on
A5), so both SoC families go through the op vllm-ascend itself uses.

Not registered, hence refused at start-up by the chunk cache with a message:
MLA/SFA/DSA (latent caches; also refused earlier for `use_mla` models),
Ascend's int8 "C8" KV cache (`AscendC8AttentionBackendImpl`), and every other
implementation. See docs/ascend.md: none of this was executed on an NPU.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
    register_cache_writer,
)

# How users pick it: vllm-ascend's attention backend for standard attention.
ASCEND_BACKEND = "ASCEND"


def write_rows_npu(
    layer: Any,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    forward_context: Any,
) -> None:
    """Write K/V rows [n, num_kv_heads, head_size] at paged slots [n]."""
    # NOTE: resolved at call time so that the SoC's adaptor (chosen when
    # device_op is imported) is the one used.
    from vllm_ascend.device import device_op

    key_cache, value_cache = layer.kv_cache[0], layer.kv_cache[1]
    device_op.DeviceOperator.reshape_and_cache(
        key=key.contiguous(),
        value=value.contiguous(),
        key_cache=key_cache,
        value_cache=value_cache,
        # Ascend's cache-write ops take int32 slots (its metadata builder's).
        slot_mapping=slot_mapping.to(torch.int32),
    )


def register_npu_chunk_cache() -> None:
    """Register the NPU cache writer (called from vllm-ascend's connector
    registration, in every process)."""
    register_cache_writer("AscendAttentionBackendImpl", ASCEND_BACKEND, write_rows_npu)
