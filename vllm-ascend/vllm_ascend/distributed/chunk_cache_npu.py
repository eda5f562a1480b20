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

It also registers a latent writer and reader for Ascend's MLA
(`AscendMLAImpl`, vllm-ascend's `mla_v1`). Its cache is a tuple per layer,
`(latent [num_blocks, 128, 1, kv_lora_rank], rope [num_blocks, 128, 1,
rope_dim])`, written by the fused `npu_kv_rmsnorm_rope_cache` (RMSNorm, rope
and the scatter in one op, so it cannot take rows that are already normed and
rotated). Rows that are (the PCP path of vllm-ascend's SFA, `sfa_cp.exec_kv`)
go through `_npu_reshape_and_cache(key=kv_c, value=k_pe, key_cache=latent,
value_cache=rope)`: the loader writes through that op, via
`DeviceOperator.reshape_and_cache` (A5: `npu_scatter_pa_kv_cache`, whose
"Norm" mode takes different key and value widths). Ascend's MLA rope is
GPT-J's rotation stored de-interleaved (`npu_interleave_rope`: the even
values, then the odd ones); the pool keeps vLLM's interleaved row, so the
reader re-interleaves and the writer de-interleaves (a permutation: the bytes
read are the bytes written).

It registers, with the fork's remapper (`position_remapper.register_rope_rule`,
exact types), the rope classes vLLM's CustomOp dispatch builds on an NPU in
place of vLLM's (`vllm_ascend.utils.register_ascend_customop`), each read to
keep its parent's angle rule (below, `register_ascend_ropes`); the others
stay refused by name.

It also registers the rule under which vllm-ascend's BalanceScheduler runs vLLM's own schedule()
(balance scheduling off), which boundary recompute needs (support.check_scheduler).
On a vLLM without the chunk cache (vllm-ascend next to a stock vLLM) it
registers nothing: no fork-only module is imported at import time.

It registers vllm-ascend's SFA (`AscendSFAImpl`, `sfa_v1`: DeepSeek-V3.2's
sparse attention): the cache is `(latent, rope,
indexer key [num_blocks, 128, 1, index_head_dim])` in the model dtype (or the
first two parts alone on a layer that reuses another's top-k), the latent
written as MLA's above and the indexer key, rotated on its first
qk_rope_head_dim values with MLA's cos/sin (neox pairing,
`is_rope_neox_style`), by `npu_scatter_nd_update_` into the third part, as
`AscendSFAImpl.forward` writes it (docs/design/sparse.md). With
`enable_sparse_li_c8` the key is captured before quantization from the seam of
patch 0003 and quantized on load by the layer's own `quantize_indexer_key`
(Hadamard transform, per-token `npu_dynamic_quant`), key and scale scattered
into parts 2 and 3: built, but refused (ACCEPT_QUANTIZED_INDEXER, below: a
quantized indexer is not translation-invariant). Refused per layer, by name:
`enable_sparse_li_c8`, `enable_sparse_sfa_c8` (a
packed 656-byte latent), DSA context parallelism,
the fused decode writes (MLAPO, SFA prolog v3), `c8_enable_reshape_optim`
(`store_kv_block`), the NZ cache, and `glm_moe_dsa`'s interleaved indexer rope.

Not registered, hence refused at start-up with a message: vllm-ascend's DSA
(`AscendDSAImpl`), Ascend's int8 "C8" KV cache (`AscendC8AttentionBackendImpl`), and every other
implementation; the Ascend MLA reader refuses the NZ cache (`enable_kv_nz`)
and a quantized latent cache, and its layer check MLAPO's fused decode write
where a layer keeps it after its weights loaded (`impl.enable_mlapo`).
See docs/ascend.md: none of this was executed on an NPU.
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


def deinterleave_rope(k_pe: torch.Tensor) -> torch.Tensor:
    """VLLM's GPT-J row (pairs at 2i, 2i+1) -> Ascend's stored row (i, i+half)."""
    return torch.cat((k_pe[..., 0::2], k_pe[..., 1::2]), dim=-1)


def interleave_rope(stored: torch.Tensor) -> torch.Tensor:
    """Ascend's stored row (pairs at i, i+half) -> vLLM's GPT-J row."""
    half = stored.shape[-1] // 2
    return torch.stack((stored[..., :half], stored[..., half:]), dim=-1).flatten(-2)


def mla_cache_parts(kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent, rope) caches of an AscendMLAImpl layer, or ValueError naming
    what the chunk cache cannot write (checked at start-up: LatentLayer.of
    reads zero rows through the reader)."""
    from vllm_ascend.ascend_config import get_ascend_config

    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
        parts = len(kv_cache) if isinstance(kv_cache, (tuple, list)) else "one tensor"
        raise ValueError(
            "chunk cache: an Ascend MLA cache is (latent, rope) caches, got "
            f"{parts} (an indexer or C8 cache is not supported)"
        )
    latent, rope = kv_cache
    for part in (latent, rope):
        if (
            part.dim() != 4
            or part.shape[2] != 1
            or not part.dtype.is_floating_point
            or part.element_size() < 2
        ):
            raise ValueError(
                "chunk cache: Ascend MLA caches must be [blocks, block_size, 1, dim] in "
                f"the model dtype, got {tuple(part.shape)} {part.dtype} (a quantized "
                "latent cache, fa_quant or C8, is not supported)"
            )
    if latent.shape[:2] != rope.shape[:2] or latent.dtype != rope.dtype:
        raise ValueError("chunk cache: Ascend MLA latent and rope caches do not match")
    # NOTE: FRACTAL_NZ decode writes (enable_kv_nz) write the cache with
    # another op than the "PA" scatter this writer uses. MLAPO is per layer:
    # check_mla_layer.
    if getattr(get_ascend_config(), "enable_kv_nz", False):
        raise ValueError("chunk cache does not support Ascend MLA with enable_kv_nz")
    return latent, rope


def check_mla_layer(name: str, layer: Any) -> None:
    """Refuse an AscendMLAImpl layer, as its weights left it, whose decode
    writes its cache with another op than the writer's: MLAPO's fused decode
    preprocessing. NOTE: per layer, not the config's VLLM_ASCEND_ENABLE_MLAPO
    (on by default; on A5 it is on for every instance, on A2/A3 only on PD
    decode instances): vllm-ascend turns it off in
    `AscendMLAImpl.process_weights_after_loading` for a layer whose
    fused_qkv_a_proj is not W8A8 (or W8A8-MXFP8), which is the case of every
    bf16 checkpoint. Also refused: a layer with fa_quant (a quantized latent
    cache) or the NZ cache."""
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
            raise ValueError(
                f"chunk cache does not support Ascend MLA layer {name} with {what}"
            )


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
    """(latent, rope, indexer parts) caches of an AscendSFAImpl layer: indexer parts ()
    on a layer without an indexer (skip_topk), (key,) in the model dtype, or (key,
    scale) with enable_sparse_li_c8; ValueError naming what the chunk cache cannot
    write (enable_sparse_sfa_c8's packed latent)."""
    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) not in (2, 3, 4):
        parts = len(kv_cache) if isinstance(kv_cache, (tuple, list)) else "one tensor"
        raise ValueError(
            "chunk cache: an Ascend SFA cache is (latent, rope[, indexer key[, scale]]) "
            f"caches, got {parts} (enable_sparse_sfa_c8's packed latent is not supported)"
        )
    latent, rope = mla_cache_parts(tuple(kv_cache[:2]))
    index = tuple(kv_cache[2:])
    for part in index:
        if part.dim() != 4 or part.shape[:3] != latent.shape[:3]:
            raise ValueError(
                "chunk cache: Ascend SFA indexer caches must be [blocks, block_size, 1, dim], "
                f"got {tuple(part.shape)}"
            )
    if len(index) == 1 and index[0].dtype != latent.dtype:
        raise ValueError(
            "chunk cache: an Ascend SFA indexer key cache without its scale part must be in "
            f"the latent's dtype, got {index[0].dtype}"
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
    torch_npu.npu_scatter_nd_update_(
        cache.view(-1, width), slots.view(-1, 1), rows.to(cache.dtype).view(-1, width)
    )


def write_indexer_key_npu(
    layer: Any, keys: torch.Tensor, slots: torch.Tensor, kv_cache: Any
) -> None:
    """Indexer keys [n, index_head_dim], already rotated at their real positions, at
    paged `slots` [n], as `AscendSFAImpl.forward` writes `k_li` (sfa_v1.py, the
    `npu_scatter_nd_update_` path): as is into part 2; with enable_sparse_li_c8
    through the layer's own `quantize_indexer_key` (Hadamard transform, per-token
    `npu_dynamic_quant`, patch 0003), the key into part 2 and its scale into part 3."""
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


def read_indexer_key_npu(
    layer: Any, kv_cache: Any, slots: torch.Tensor
) -> torch.Tensor | None:
    """The indexer keys written at `slots` this step, before any quantization. In the
    plain configuration from the cache (bf16, no Hadamard transform: that comes with C8
    only); with enable_sparse_li_c8 from the seam of patch 0003 (the step's key before
    quantization and its slots). None on a layer without an indexer part (skip_topk)."""
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
    # The rows of `slots` in this step's keys (each slot written once per step).
    # NOTE: the capture asks only for slots its child wrote this step (capture
    # path), so every slot is found; no device assertion (docs/ascend.md).
    order = torch.argsort(step_slots)
    found = order[
        torch.searchsorted(step_slots[order], slots.to(torch.int64)).clamp(
            max=order.numel() - 1
        )
    ]
    return keys.view(-1, keys.shape[-1]).index_select(0, found)


# NOTE: enable_sparse_li_c8 is refused although its data path is built (patch
# 0003's seam, the quantizing writer; stub-checked): a key quantized after the rope
# is not translation-invariant (the rounding depends on the absolute angle), so the
# isolation forward itself changes when every position moves, and a chunk computed
# at 0.. selects, at its real positions, up to quantization flips what a fresh one
# would: not exact (docs/design/sparse.md: on the tiny V3.2 with CUDA's fp8
# indexer arithmetic, ~8% of the selections flip under a shift of 5). The stub
# check turns this on to run the built path.
ACCEPT_QUANTIZED_INDEXER = False


def check_sfa_layer(name: str, layer: Any) -> None:
    """Refuse an AscendSFAImpl layer whose cache the SFA writers do not write as it
    does (read in vllm-ascend 0.23.0.post1's sfa_v1.py)."""
    from vllm_ascend.ascend_config import get_ascend_config

    impl = layer.impl
    for flag, what in (
        (
            "enable_sparse_sfa_c8",
            "enable_sparse_sfa_c8 (the packed 656-byte latent cache)",
        ),
        ("enable_dsa_cp", "DSA context parallelism (enable_dsa_cp)"),
        (
            "enable_mlapo",
            "MLAPO's fused write (VLLM_ASCEND_ENABLE_MLAPO=1; set it to 0)",
        ),
        ("enable_sfa_prolog_v3", "SFA prolog v3's fused decode write"),
        ("enable_kv_nz", "enable_kv_nz (FRACTAL_NZ writes)"),
        (
            "use_torch_npu_lightning_indexer",
            "torch_npu's lightning indexer (glm_moe_dsa)",
        ),
    ):
        if getattr(impl, flag, False):
            raise ValueError(
                f"chunk cache does not support Ascend SFA layer {name} with {what}"
            )
    if getattr(impl, "has_indexer", False) and not getattr(
        impl, "is_rope_neox_style", True
    ):
        raise ValueError(
            f"chunk cache does not support Ascend SFA layer {name} with an interleaved "
            "indexer rope (glm_moe_dsa: its Triton and torch paths pair differently)"
        )
    if getattr(get_ascend_config(), "c8_enable_reshape_optim", False):
        raise ValueError(
            f"chunk cache does not support Ascend SFA layer {name} with "
            "c8_enable_reshape_optim (store_kv_block writes the indexer cache)"
        )
    if getattr(impl, "enable_sparse_li_c8", False) and not ACCEPT_QUANTIZED_INDEXER:
        raise ValueError(
            f"chunk cache does not support Ascend SFA layer {name} with enable_sparse_li_c8: "
            "an indexer key quantized after the rope is not translation-invariant, so a "
            "loaded chunk's top-k is the isolation semantics' only up to quantization "
            "flips (docs/design/sparse.md)"
        )
    if getattr(impl, "enable_sparse_li_c8", False) and not hasattr(
        impl, "quantize_indexer_key"
    ):
        raise ValueError(
            f"chunk cache: Ascend SFA layer {name} has enable_sparse_li_c8 but vllm-ascend "
            "lacks the fork's seam (patch 0003: quantize_indexer_key, chunk_cache_k_li)"
        )


def prepare_sfa_indexer_layer(name: str, layer: Any) -> None:
    """check_sfa_layer, then (start-up, chunk cache on) turn on patch 0003's seam on a
    C8 layer: its forward keeps the indexer key before quantization for the capture."""
    check_sfa_layer(name, layer)
    if getattr(layer.impl, "enable_sparse_li_c8", False):
        layer.impl.chunk_cache_capture = True


def _sfa_neox_style(layer: Any) -> bool:
    return bool(layer.impl.is_rope_neox_style)


def _always_halves(rope: Any) -> bool:
    return True


def register_ascend_ropes() -> None:
    """Accept vllm-ascend's rope classes whose angle rule is their parent's
    (read in vllm-ascend 0.23.0.post1, vllm_ascend/ops/rotary_embedding.py;
    never executed on an NPU). Exact types: a subclass stays refused.

    * AscendRotaryEmbedding, AscendYaRNRotaryEmbedding: their __init__ is the
      parent's (inv_freq and the [pos, cos | sin] cos_sin_cache built by the
      parent's own _compute_inv_freq / _compute_cos_sin_cache; the YaRN one
      only changes the default of `truncate`, which that method reads), and
      their forward rotates K with that cos_sin_cache and `is_neox_style`
      (`torch_npu._npu_rotary_embedding` or the Triton kernel, vLLM's pairing):
      K is stored in vLLM's layout.
    * AscendDeepseekScalingRotaryEmbedding: DeepSeek's YaRN rebuilt in its own
      fp32 torch code (`_set_cos_sin_cache`: the ramp without
      extrapolation_factor), frequencies kept in its `inv_freq` buffer, cache
      `cat(cos(p f) * mscale, sin(p f) * mscale)` as vLLM's: the rule takes
      that buffer. Its forward de-interleaves a GPT-J rope's q/k (evens, then
      odds) and rotates neox-style, so keys it produced pair (i, i + half)
      whatever `is_neox_style` says. MLA layers do not use that forward
      (AscendMLAImpl rotates k_pe itself, interleaved): their reader fixes the
      layout of the rows instead (k_pe_neox_style=False below).
    * Not registered, so refused: AscendMRotaryEmbedding (M-RoPE, refused as
      its parent), AscendRotaryEmbedding310 (310P: rotates with the process-
      global cos/sin slice `get_cos_and_sin_slice()`, filled by the runner from
      the first rope recorded, not from its own cache: not verifiable from the
      rope object), and anything else.
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
        # NOTE: the safe direction: unregistered ropes are refused at start-up
        # (by name) only where the chunk cache is on; this runs in every
        # process, so it must not break one that does not use it.
        logger.warning(
            "chunk cache: vllm-ascend's rope classes not registered (%s); "
            "models using them will be refused",
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


# The fork's chunk cache in vLLM; absent from a stock vLLM.
_CHUNK_CACHE_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache"
# vllm-ascend's balance scheduler (patch_balance_schedule rebinds vLLM's
# Scheduler to it in every process that applies its platform patches).
_BALANCE_SCHEDULER = (
    "vllm_ascend.patch.platform.patch_balance_schedule.BalanceScheduler"
)


def _balance_scheduler_runs_vllm_schedule(vllm_config: Any) -> bool:
    """BalanceScheduler.schedule() calls vLLM's (super().schedule()) unless
    balance scheduling is on or preemption is disabled on a PD prefill node
    (read in vllm-ascend 0.23.0.post1, patch_balance_schedule.py:107-111; the
    same two functions it asks). Only called where that class is in use, so
    its module is already imported."""
    from vllm_ascend.patch.platform import patch_balance_schedule as balance

    return not (
        balance._balance_scheduling_enabled(vllm_config)
        or balance._disable_preemption_on_prefill_node(vllm_config)
    )


def register_npu_chunk_cache() -> None:
    """Register the NPU cache writers, rope rules and scheduler rule (called
    from vllm-ascend's connector registration, in every process). Nothing on a vLLM without the chunk cache: vllm-ascend may be
    installed next to a stock vLLM, whose plugin loader calls this unguarded."""
    if importlib.util.find_spec(_CHUNK_CACHE_PACKAGE) is None:
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        register_cache_writer,
        register_latent_writer,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
        register_delegating_scheduler,
    )

    register_delegating_scheduler(
        _BALANCE_SCHEDULER, _balance_scheduler_runs_vllm_schedule
    )
    register_cache_writer("AscendAttentionBackendImpl", ASCEND_BACKEND, write_rows_npu)
    # NOTE: AscendMlaCPImpl (context parallel) and AscendDSAImpl are not
    # registered: refused by name. k_pe: Ascend's MLA rotates it
    # interleaved in every path (npu_interleave_rope, npu_kv_rmsnorm_rope_cache)
    # whatever the rope's style, and read_latent_npu returns it re-interleaved:
    # GPT-J pairs in the pool.
    register_latent_writer(
        "AscendMLAImpl",
        ASCEND_MLA_BACKEND,
        write_latent_npu,
        read_latent_npu,
        k_pe_neox_style=False,
        check_layer=check_mla_layer,
    )
    # SFA: the same latent write on its first two parts (its k_pe is rotated
    # interleaved by npu_kv_rmsnorm_rope_cache as MLA's), and the indexer key.
    register_latent_writer(
        "AscendSFAImpl",
        ASCEND_SFA_BACKEND,
        write_sfa_latent_npu,
        read_sfa_latent_npu,
        k_pe_neox_style=False,
        check_layer=check_sfa_layer,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.indexer_keys_layers import (
        IndexerWriter,
        register_indexer_writer,
    )

    register_indexer_writer(
        "AscendSFAImpl",
        IndexerWriter(
            ASCEND_SFA_BACKEND,
            write_indexer_key_npu,
            read_indexer_key_npu,
            _sfa_neox_style,
            check_layer=prepare_sfa_indexer_layer,
        ),
    )
    register_ascend_ropes()
