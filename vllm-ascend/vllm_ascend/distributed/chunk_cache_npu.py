# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NPU side of vLLM's chunk cache (vllm-ascend overlay module).

The chunk cache is device-generic (vllm/.../kv_connector/v1/chunk_cache/): the
pool lives on each layer's KV cache device, K is re-rotated in fp32 torch ops,
and rows are written through the attention backend's own cache-write op. This
module registers those ops for Ascend:

- standard attention (`AscendAttentionBackendImpl`): `reshape_and_cache` into
  separate key and value caches, the op vllm-ascend itself uses;
- MLA (`AscendMLAImpl`): a `(latent, rope)` cache written through the same op,
  as the PCP path of vllm-ascend's SFA writes rows already normed and rotated.
  Ascend stores the rope part de-interleaved (`npu_interleave_rope`), so the
  reader re-interleaves into vLLM's row and the writer de-interleaves;
- SFA (`AscendSFAImpl`, DeepSeek-V3.2): MLA's write on the first two parts, and
  the indexer key scattered into the third as `forward` writes it;
- vllm-ascend's rope classes that keep their parent's angle rule, and the rule
  under which its BalanceScheduler runs vLLM's own schedule().

Everything else (DSA, the C8 KV cache, the NZ cache, MLAPO's fused decode
write, ...) is refused at start-up. On a vLLM without the chunk cache nothing is
registered. None of this was executed on an NPU (docs/ascend.md).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from vllm.logger import logger

# How users pick it: vllm-ascend's attention backend for standard attention.
ASCEND_BACKEND = "ASCEND"
# vllm-ascend's MLA backend (AscendMLABackend.get_name()).
ASCEND_MLA_BACKEND = "ASCEND_MLA"
# vllm-ascend's sparse MLA backend for DeepSeek-V3.2 (AscendSFABackend.get_name()).
ASCEND_SFA_BACKEND = "ASCEND_SFA"


def write_rows_npu(
    layer: Any,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    forward_context: Any,
) -> None:
    """Write K/V rows [n, num_kv_heads, head_size] at paged slots [n]."""
    # Imported here: the SoC's adaptor is chosen when device_op is imported.
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


def deinterleave_rope(k_pe: torch.Tensor) -> torch.Tensor:
    """A GPT-J row as vLLM keeps it (pairs at 2i, 2i+1) -> Ascend's (i, i+half)."""
    return torch.cat((k_pe[..., 0::2], k_pe[..., 1::2]), dim=-1)


def interleave_rope(stored: torch.Tensor) -> torch.Tensor:
    """Ascend's stored row (pairs at i, i+half) -> vLLM's GPT-J row."""
    half = stored.shape[-1] // 2
    return torch.stack((stored[..., :half], stored[..., half:]), dim=-1).flatten(-2)


def mla_cache_parts(kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent, rope) caches of an AscendMLAImpl layer, or ValueError naming
    what the chunk cache cannot write."""
    from vllm_ascend.ascend_config import get_ascend_config

    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
        parts = len(kv_cache) if isinstance(kv_cache, (tuple, list)) else "one tensor"
        raise ValueError(
            "chunk cache: an Ascend MLA cache is (latent, rope) caches, got "
            f"{parts} (an indexer or C8 cache is not supported)"
        )
    latent, rope = kv_cache
    for part in (latent, rope):
        if part.dim() != 4 or part.shape[2] != 1 or not part.dtype.is_floating_point or part.element_size() < 2:
            raise ValueError(
                "chunk cache: Ascend MLA caches must be [blocks, block_size, 1, "
                f"dim] in the model dtype, got {tuple(part.shape)} {part.dtype} "
                "(a quantized latent cache, fa_quant or C8, is not supported)"
            )
    if latent.shape[:2] != rope.shape[:2] or latent.dtype != rope.dtype:
        raise ValueError("chunk cache: Ascend MLA latent and rope caches do not match")
    # FRACTAL_NZ decode writes use another op than this writer's scatter.
    if getattr(get_ascend_config(), "enable_kv_nz", False):
        raise ValueError("chunk cache does not support Ascend MLA with enable_kv_nz")
    return latent, rope


def check_mla_layer(name: str, layer: Any) -> None:
    """Refuse an AscendMLAImpl layer, as its weights left it, whose cache is
    written with another op than the writer's. MLAPO is checked per layer:
    vllm-ascend turns it off after loading on a layer that is not W8A8 (every
    bf16 checkpoint), whatever VLLM_ASCEND_ENABLE_MLAPO says."""
    impl = layer.impl
    for flag, what in (
        (
            "enable_mlapo",
            "MLAPO's fused decode write (W8A8 MLA "
            "checkpoints with VLLM_ASCEND_ENABLE_MLAPO=1, the default; "
            "set it to 0)",
        ),
        ("fa_quant_layer", "fa_quant (an int8/fp8 latent cache)"),
        ("enable_kv_nz", "enable_kv_nz (FRACTAL_NZ decode writes)"),
    ):
        if getattr(impl, flag, False):
            raise ValueError(f"chunk cache does not support Ascend MLA layer {name} with {what}")


def write_latent_npu(
    layer: Any,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slots: torch.Tensor,
    kv_cache: Any,
) -> None:
    """Write latent rows (kv_c [n, rank], k_pe [n, rope_dim] in vLLM's GPT-J
    layout, already rotated) at paged `slots` [n] of an AscendMLAImpl cache."""
    from vllm_ascend.device import device_op

    latent, rope = mla_cache_parts(kv_cache)
    # Refused at start-up (support.check_attention_layer): never raises here.
    check_mla_layer(getattr(layer, "layer_name", "?"), layer)
    n = kv_c.shape[0]
    device_op.DeviceOperator.reshape_and_cache(
        key=kv_c.reshape(n, 1, -1).contiguous(),
        value=deinterleave_rope(k_pe).reshape(n, 1, -1).contiguous(),
        key_cache=latent,
        value_cache=rope,
        slot_mapping=slots.to(torch.int32),
    )


def read_latent_npu(kv_cache: Any, slots: torch.Tensor) -> torch.Tensor:
    """Rows [n, rank + rope_dim] at paged `slots` [n], k_pe re-interleaved
    into vLLM's GPT-J layout: exactly what write_latent_npu wrote."""
    latent, rope = mla_cache_parts(kv_cache)
    kv_c = latent.view(-1, latent.shape[-1]).index_select(0, slots)
    k_pe = rope.view(-1, rope.shape[-1]).index_select(0, slots)
    return torch.cat((kv_c, interleave_rope(k_pe)), dim=-1)


def sfa_cache_parts(
    kv_cache: Any,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """(latent, rope, indexer parts) of an AscendSFAImpl layer's cache: the
    indexer parts are () without an indexer (skip_topk), (key,) or, with
    enable_sparse_li_c8, (key, scale); ValueError naming what the chunk cache
    cannot write."""
    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) not in (2, 3, 4):
        parts = len(kv_cache) if isinstance(kv_cache, (tuple, list)) else "one tensor"
        raise ValueError(
            "chunk cache: an Ascend SFA cache is (latent, rope[, indexer key[, "
            f"scale]]) caches, got {parts} (enable_sparse_sfa_c8's packed latent "
            "is not supported)"
        )
    latent, rope = mla_cache_parts(tuple(kv_cache[:2]))
    index = tuple(kv_cache[2:])
    for part in index:
        if part.dim() != 4 or part.shape[:3] != latent.shape[:3]:
            raise ValueError(
                f"chunk cache: Ascend SFA indexer caches must be [blocks, block_size, 1, dim], got {tuple(part.shape)}"
            )
    if len(index) == 1 and index[0].dtype != latent.dtype:
        raise ValueError(
            "chunk cache: an Ascend SFA indexer key cache without its scale part "
            f"must be in the latent's dtype, got {index[0].dtype}"
        )
    return latent, rope, index


def write_sfa_latent_npu(
    layer: Any,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slots: torch.Tensor,
    kv_cache: Any,
) -> None:
    """MLA's latent write (write_latent_npu) on an SFA cache's first two parts."""
    latent, rope, _ = sfa_cache_parts(kv_cache)
    write_latent_npu(layer, kv_c, k_pe, slots, (latent, rope))


def read_sfa_latent_npu(kv_cache: Any, slots: torch.Tensor) -> torch.Tensor:
    latent, rope, _ = sfa_cache_parts(kv_cache)
    return read_latent_npu((latent, rope), slots)


def _scatter_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    import torch_npu

    width = rows.shape[-1]
    torch_npu.npu_scatter_nd_update_(cache.view(-1, width), slots.view(-1, 1), rows.to(cache.dtype).view(-1, width))


def write_indexer_key_npu(layer: Any, keys: torch.Tensor, slots: torch.Tensor, kv_cache: Any) -> None:
    """Indexer keys [n, index_head_dim], rotated at their real positions, at
    paged `slots` [n], as `AscendSFAImpl.forward` writes `k_li`: as is, or with
    enable_sparse_li_c8 quantized by the layer's `quantize_indexer_key` (key
    and scale into parts 2 and 3)."""
    _, _, index = sfa_cache_parts(kv_cache)
    impl = layer.impl
    check_sfa_layer(getattr(layer, "layer_name", "?"), layer)
    slots = slots.to(torch.int64)
    if getattr(impl, "enable_sparse_li_c8", False):
        quantized, scale = impl.quantize_indexer_key(keys)
        _scatter_rows(index[0], slots, quantized)
        _scatter_rows(index[1], slots, scale)
    else:
        _scatter_rows(index[0], slots, keys)


def read_indexer_key_npu(layer: Any, kv_cache: Any, slots: torch.Tensor) -> torch.Tensor | None:
    """The indexer keys written at `slots` this step, before any quantization:
    from the cache, or with enable_sparse_li_c8 from the layer's capture seam
    (the step's keys and their slots). None without an indexer (skip_topk)."""
    latent, _, index = sfa_cache_parts(kv_cache)
    if not index:
        return None
    impl = layer.impl
    if not getattr(impl, "enable_sparse_li_c8", False):
        return index[0].view(-1, index[0].shape[-1]).index_select(0, slots)
    keys = getattr(impl, "chunk_cache_k_li", None)
    if slots.numel() == 0 or keys is None:
        # At start-up (zero rows): the key's width, in the model dtype.
        return torch.zeros((0, impl.head_dim), dtype=latent.dtype, device=slots.device)
    step_slots = impl.chunk_cache_k_li_slots.to(torch.int64).view(-1)
    # The rows of `slots` in this step's keys: the capture asks only for
    # slots its child wrote this step, so every slot is found.
    order = torch.argsort(step_slots)
    found = order[torch.searchsorted(step_slots[order], slots.to(torch.int64)).clamp(max=order.numel() - 1)]
    return keys.view(-1, keys.shape[-1]).index_select(0, found)


# enable_sparse_li_c8 is refused although its data path is built: a key
# quantized after the rope is not translation-invariant, so a moved chunk's
# top-k is not exact (docs/design/sparse.md). The stub check turns this on.
ACCEPT_QUANTIZED_INDEXER = False


def check_sfa_layer(name: str, layer: Any) -> None:
    """Refuse an AscendSFAImpl layer whose cache the SFA writers do not write
    as it does (vllm-ascend 0.23.0.post1's sfa_v1.py)."""
    from vllm_ascend.ascend_config import get_ascend_config

    impl = layer.impl
    for flag, what in (
        ("enable_sparse_sfa_c8", "enable_sparse_sfa_c8 (a packed 656-byte latent)"),
        ("enable_dsa_cp", "DSA context parallelism (enable_dsa_cp)"),
        ("enable_mlapo", "MLAPO's fused write (set VLLM_ASCEND_ENABLE_MLAPO=0)"),
        ("enable_sfa_prolog_v3", "SFA prolog v3's fused decode write"),
        ("enable_kv_nz", "enable_kv_nz (FRACTAL_NZ writes)"),
        ("use_torch_npu_lightning_indexer", "torch_npu's lightning indexer"),
    ):
        if getattr(impl, flag, False):
            raise ValueError(f"chunk cache does not support Ascend SFA layer {name} with {what}")
    if getattr(impl, "has_indexer", False) and not getattr(impl, "is_rope_neox_style", True):
        raise ValueError(
            f"chunk cache does not support Ascend SFA layer {name} with an interleaved indexer rope (glm_moe_dsa)"
        )
    if getattr(get_ascend_config(), "c8_enable_reshape_optim", False):
        raise ValueError(
            f"chunk cache does not support Ascend SFA layer {name} with "
            "c8_enable_reshape_optim (store_kv_block writes the indexer cache)"
        )
    li_c8 = getattr(impl, "enable_sparse_li_c8", False)
    if li_c8 and not ACCEPT_QUANTIZED_INDEXER:
        raise ValueError(
            f"chunk cache does not support Ascend SFA layer {name} with "
            "enable_sparse_li_c8: an indexer key quantized after the rope is not "
            "translation-invariant (docs/design/sparse.md)"
        )
    if li_c8 and not hasattr(impl, "quantize_indexer_key"):
        raise ValueError(
            f"chunk cache: Ascend SFA layer {name} has enable_sparse_li_c8 but this "
            "vllm-ascend lacks quantize_indexer_key and chunk_cache_k_li"
        )


def prepare_sfa_indexer_layer(name: str, layer: Any) -> None:
    """check_sfa_layer, then on a C8 layer have its forward keep the indexer
    key before quantization for the capture."""
    check_sfa_layer(name, layer)
    if getattr(layer.impl, "enable_sparse_li_c8", False):
        layer.impl.chunk_cache_capture = True


def _sfa_neox_style(layer: Any) -> bool:
    return bool(layer.impl.is_rope_neox_style)


def _always_halves(rope: Any) -> bool:
    return True


def register_ascend_ropes() -> None:
    """Accept vllm-ascend's rope classes whose angle rule is their parent's
    (vllm-ascend 0.23.0.post1, ops/rotary_embedding.py), by exact type.

    AscendRotaryEmbedding and AscendYaRNRotaryEmbedding build their parent's
    cos_sin_cache and rotate K with it in vLLM's pairing.
    AscendDeepseekScalingRotaryEmbedding rebuilds DeepSeek's YaRN in its own
    fp32 code, keeping its frequencies in `inv_freq`, and rotates neox-style
    after de-interleaving, so its keys pair (i, i + half) whatever
    `is_neox_style` says. Refused: AscendMRotaryEmbedding (as its parent) and
    AscendRotaryEmbedding310 (it rotates with a process-global cos/sin slice
    that is not the rope object's own).
    """
    from vllm.model_executor.layers.rotary_embedding import (
        RotaryEmbedding,
        YaRNScalingRotaryEmbedding,
    )
    from vllm.v1.worker.position_remapper import (
        register_rope_rule,
        yarn_from_inv_freq_buffer,
    )

    try:
        from vllm_ascend.ops.rotary_embedding import (
            AscendDeepseekScalingRotaryEmbedding,
            AscendRotaryEmbedding,
            AscendYaRNRotaryEmbedding,
        )
    except ImportError as e:
        # Unregistered ropes are refused where the chunk cache is on; this
        # runs in every process and must not break one that does not use it.
        logger.warning(
            "chunk cache: vllm-ascend's rope classes not registered (%s); models using them will be refused",
            e,
        )
        return

    register_rope_rule(AscendRotaryEmbedding, RotaryEmbedding)
    register_rope_rule(AscendYaRNRotaryEmbedding, YaRNScalingRotaryEmbedding)
    register_rope_rule(
        AscendDeepseekScalingRotaryEmbedding,
        yarn_from_inv_freq_buffer,
        stored_neox_style=_always_halves,
    )


# Absent from a vLLM without the chunk cache.
_CHUNK_CACHE_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache"
# patch_balance_schedule rebinds vLLM's Scheduler to it.
_BALANCE_SCHEDULER = "vllm_ascend.patch.platform.patch_balance_schedule.BalanceScheduler"


def _balance_scheduler_runs_vllm_schedule(vllm_config: Any) -> bool:
    """BalanceScheduler.schedule() calls vLLM's unless balance scheduling is
    on or preemption is disabled on a PD prefill node (vllm-ascend
    0.23.0.post1, patch_balance_schedule.py: the same two functions it asks)."""
    from vllm_ascend.patch.platform import patch_balance_schedule as balance

    return not (
        balance._balance_scheduling_enabled(vllm_config) or balance._disable_preemption_on_prefill_node(vllm_config)
    )


def register_npu_chunk_cache() -> None:
    """Register the NPU cache writers, rope rules and scheduler rule (from
    vllm-ascend's connector registration, in every process); nothing on a
    vLLM without the chunk cache."""
    if importlib.util.find_spec(_CHUNK_CACHE_PACKAGE) is None:
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        register_cache_writer,
        register_latent_writer,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
        register_delegating_scheduler,
    )

    register_delegating_scheduler(_BALANCE_SCHEDULER, _balance_scheduler_runs_vllm_schedule)
    register_cache_writer("AscendAttentionBackendImpl", ASCEND_BACKEND, write_rows_npu)
    # AscendMlaCPImpl and AscendDSAImpl stay refused by name. Ascend's MLA
    # rotates k_pe interleaved in every path, whatever the rope's style.
    register_latent_writer(
        "AscendMLAImpl",
        ASCEND_MLA_BACKEND,
        write_latent_npu,
        read_latent_npu,
        k_pe_neox_style=False,
        check_layer=check_mla_layer,
    )
    # SFA: MLA's latent write on its first two parts, and the indexer key.
    register_latent_writer(
        "AscendSFAImpl",
        ASCEND_SFA_BACKEND,
        write_sfa_latent_npu,
        read_sfa_latent_npu,
        k_pe_neox_style=False,
        check_layer=check_sfa_layer,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import (
        indexer_keys_layers as indexer,
    )

    indexer.register_indexer_writer(
        "AscendSFAImpl",
        indexer.IndexerWriter(
            ASCEND_SFA_BACKEND,
            write_indexer_key_npu,
            read_indexer_key_npu,
            _sfa_neox_style,
            check_layer=prepare_sfa_indexer_layer,
        ),
    )
    register_ascend_ropes()
