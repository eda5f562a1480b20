# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Start-up wiring of the chunk cache: connector selection and pool sizing
(docs/design/pool-budget.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.capture_path import (
    capture_hook_reason,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    CAPTURE_IN_ATTENTION,
    CONNECTOR_NAME,
    check_config,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)

# Rows per chunk-pool block (independent of vLLM's paged block size).
POOL_BLOCK_SIZE = 16


def configure_chunk_cache_connector(vllm_config: VllmConfig) -> None:
    """Refuse what the chunk cache cannot serve (support.check_config), then
    point kv_transfer_config at its connector."""
    from vllm.config import KVTransferConfig

    check_config(vllm_config)
    reason = capture_hook_reason(vllm_config)
    if reason is not None:
        _resolve_cudagraph_mode(vllm_config, reason)
    vllm_config.chunk_cache_config.resolve_sink_token_id(_bos_token_id(vllm_config))
    logger.info("Chunk cache enabled: %s", vllm_config.chunk_cache_config.describe())
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_role="kv_both",
        kv_connector_extra_config={CAPTURE_IN_ATTENTION: reason is not None},
    )


def _resolve_cudagraph_mode(vllm_config: VllmConfig, reason: str) -> None:
    """PIECEWISE CUDA graphs only where captures stay in the attention hook
    (`reason`, capture_path.py): vLLM's default FULL_AND_PIECEWISE becomes
    PIECEWISE, logged with the reason; a full mode asked for is refused."""
    from vllm.config.compilation import CUDAGraphMode

    compilation_config = vllm_config.compilation_config
    mode = compilation_config.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return
    if mode == CUDAGraphMode.FULL_AND_PIECEWISE:
        logger.info(
            "Chunk cache: cudagraph_mode FULL_AND_PIECEWISE -> PIECEWISE (%s, "
            "outside the graphs)",
            reason,
        )
        compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
        return
    raise ValueError(
        f"--enable-chunk-cache does not support cudagraph_mode={mode.name} here: "
        f"{reason}, which a full graph would capture; use PIECEWISE (the default "
        "then) or --enforce-eager"
    )


def pool_num_blocks(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Blocks of the chunk pool (same answer in the scheduler and workers)."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        return 0
    return _pool_blocks(
        vllm_config, kv_cache_config.num_blocks, groups[0].kv_cache_spec.block_size
    )


def pool_num_blocks_from_config(vllm_config: VllmConfig) -> int | None:
    """The same number in the front end, from what the engine reported at
    start-up (num_gpu_blocks); None before the engine has started."""
    num_kv_blocks = vllm_config.cache_config.num_gpu_blocks
    if not num_kv_blocks:
        return None
    return _pool_blocks(vllm_config, num_kv_blocks, vllm_config.cache_config.block_size)


def carve_chunk_pool(vllm_config: VllmConfig, available_bytes: int) -> int:
    """The KV budget left to vLLM's paged cache once the pool, the load buffers
    and the NPU's KV tensor padding are taken out."""
    cfg = vllm_config.chunk_cache_config
    scratch = load_scratch_bytes(vllm_config)
    padding = kv_allocation_padding_bytes(vllm_config)
    if cfg.chunk_pool_size_gib is not None:
        pool = int(cfg.chunk_pool_size_gib * (1 << 30))
    else:
        rest = available_bytes - scratch - padding
        pool = rest - int(rest * (1.0 - cfg.chunk_pool_fraction))
    left = available_bytes - pool - scratch - padding
    if left <= 0:
        raise ValueError(
            f"the chunk pool ({pool / (1 << 30):.3f} GiB) and its load buffers "
            f"({scratch / (1 << 30):.3f} GiB for --max-chunk-load-tokens "
            f"{cfg.max_chunk_load_tokens}; {padding / (1 << 20):.0f} MiB of KV "
            "cache alignment on NPUs) do not fit the KV cache budget of "
            f"{available_bytes / (1 << 30):.2f} GiB (both are carved out of it): "
            "lower --chunk-pool-size-gib / --chunk-pool-fraction or "
            "--max-chunk-load-tokens, or raise --gpu-memory-utilization / "
            "VLLM_CPU_KVCACHE_SPACE"
        )
    logger.info(
        "Chunk cache: KV budget %.2f GiB -> %.2f GiB for the paged KV cache, "
        "%.2f GiB for the chunk pool, %.1f MiB for its load buffers%s",
        available_bytes / (1 << 30),
        left / (1 << 30),
        pool / (1 << 30),
        scratch / (1 << 20),
        f", {padding / (1 << 20):.0f} MiB for the KV tensors' alignment"
        if padding
        else "",
    )
    return left


# What vllm-ascend adds to each KV cache tensor with a KV connector configured.
NPU_KV_TENSOR_ALIGNMENT = 2 << 20


def kv_allocation_padding_bytes(vllm_config: VllmConfig) -> int:
    """Memory vllm-ascend's KV cache allocation takes beyond vLLM's sizing: 2 MiB
    per cache tensor of a layer (SFA: three, standard attention and MLA: two)."""
    from vllm.platforms import current_platform

    if getattr(current_platform, "device_type", None) != "npu":
        return 0
    model_config = vllm_config.model_config
    layers = _max_stage_layers(model_config, vllm_config.parallel_config)
    parts = (
        3
        if getattr(model_config, "use_mla", False) and _index_head_dim(model_config)
        else 2
    )
    return parts * layers * NPU_KV_TENSOR_ALIGNMENT


# Load buffer rows where every layer should load fused (which takes none): a
# layer its self-check turns away loads through them, in pieces of this size.
FALLBACK_SCRATCH_ROWS = 512


def load_scratch_rows(vllm_config: VllmConfig) -> int:
    """Rows of the workers' load buffers: --max-chunk-load-tokens, or
    `FALLBACK_SCRATCH_ROWS` where every layer is expected to load fused."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import (
        fused_chunk_load_path,
    )

    cap = vllm_config.chunk_cache_config.max_chunk_load_tokens
    if fused_chunk_load_path.fused_load_expected(vllm_config):
        return min(cap, FALLBACK_SCRATCH_ROWS)
    return cap


def load_scratch_bytes(vllm_config: VllmConfig) -> int:
    """Bytes of the workers' load buffers (`RemapScratch`, `load_scratch_rows`
    rows of the roles of the model's kind)."""
    from vllm.v1.worker.position_remapper import RemapScratch

    model_config = vllm_config.model_config
    head = model_config.get_head_size()
    roles: tuple[tuple[str, bool, str], ...]
    if getattr(model_config, "use_mla", False):
        # One latent row [kv_c | k_pe] per token, for all heads.
        rope = model_config.hf_text_config.qk_rope_head_dim
        roles, parts = RemapScratch.LATENT, {"c": head - rope, "r": rope}
        index = _index_head_dim(model_config)
        if index:
            # Sparse MLA: the indexer key's buffers too.
            from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import (
                mla_latent_layers,
            )

            roles = roles + mla_latent_layers.INDEXER_SCRATCH
            parts = {**parts, "i": index}
    else:
        key = model_config.get_num_kv_heads(vllm_config.parallel_config) * head
        roles, parts = RemapScratch.STANDARD, {"k": key, "v": key}
    per_row = RemapScratch.row_bytes(roles, parts, pool_dtype(vllm_config))
    return load_scratch_rows(vllm_config) * per_row


def _pool_blocks(vllm_config: VllmConfig, num_kv_blocks: int, block_size: int) -> int:
    cfg = vllm_config.chunk_cache_config
    if cfg.chunk_pool_size_gib is not None:
        pool_bytes = int(cfg.chunk_pool_size_gib * (1 << 30))
        tokens = pool_bytes // max(1, pool_bytes_per_token(vllm_config))
    else:
        # kv_bytes * f / (1 - f) pool bytes; the per-token element count of
        # the two stores is the same, so only their itemsizes remain.
        f = cfg.chunk_pool_fraction
        cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        ratio = 1.0  # cache in the model dtype: same bytes per token
        if cache_dtype not in (None, "auto"):
            ratio = _kv_dtype(vllm_config).itemsize / pool_dtype(vllm_config).itemsize
        tokens = int(num_kv_blocks * block_size * ratio * f / (1.0 - f))
    return max(0, tokens // POOL_BLOCK_SIZE)


def _layer_kv_elements(vllm_config: VllmConfig) -> int:
    """K plus V elements of one token (MLA: its latent row, and a sparse MLA's
    indexer key) over one rank's KV heads and the layers of the *largest*
    pipeline stage (docs/design/pool-budget.md, "Rows per rank")."""
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    num_layers = _max_stage_layers(model_config, parallel_config)
    num_kv_heads = model_config.get_num_kv_heads(parallel_config)
    rows = 1 if getattr(model_config, "use_mla", False) else 2
    index = _index_head_dim(model_config) if rows == 1 else 0
    return num_layers * (num_kv_heads * model_config.get_head_size() * rows + index)


def _index_head_dim(model_config) -> int:
    """Values of a sparse MLA layer's indexer key (DeepSeek-V3.2: 128); 0: dense."""
    text = getattr(model_config, "hf_text_config", None)
    if getattr(text, "index_topk", None) is None:
        return 0
    return int(getattr(text, "index_head_dim", 0) or 0)


def _max_stage_layers(model_config, parallel_config) -> int:
    pp_size = getattr(parallel_config, "pipeline_parallel_size", 1) or 1
    if pp_size <= 1:
        return model_config.get_num_layers(parallel_config)
    from vllm.distributed.utils import get_pp_indices

    total = model_config.get_total_num_hidden_layers()
    return max(
        end - start
        for start, end in (
            get_pp_indices(total, rank, pp_size) for rank in range(pp_size)
        )
    )


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    # Unknown names (e.g. nvfp4) count as one byte: never over-sized.
    return STR_DTYPE_TO_TORCH_DTYPE.get(dtype, torch.uint8)


def pool_dtype(vllm_config: VllmConfig) -> torch.dtype:
    """The pool's dtype: the model's, whatever the KV cache's
    (docs/design/pool-budget.md, "The pool's dtype")."""
    return _as_dtype(vllm_config.model_config.dtype)


def _kv_dtype(vllm_config: VllmConfig) -> torch.dtype:
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if cache_dtype in (None, "auto"):
        return pool_dtype(vllm_config)
    return _as_dtype(cache_dtype)


def pool_bytes_per_token(vllm_config: VllmConfig) -> int:
    """Bytes one token takes in the pool (`pool_dtype`)."""
    return _layer_kv_elements(vllm_config) * pool_dtype(vllm_config).itemsize


def kv_bytes_per_token(vllm_config: VllmConfig) -> int:
    """Bytes one token takes in vLLM's paged KV cache (its cache dtype)."""
    return _layer_kv_elements(vllm_config) * _kv_dtype(vllm_config).itemsize


def _bos_token_id(vllm_config: VllmConfig) -> int | None:
    """The tokenizer's BOS token id (the default sink of `sink` mode)."""
    cfg = vllm_config.chunk_cache_config
    model_config = vllm_config.model_config
    if cfg.chunk_context != "sink" or cfg.chunk_sink_token_id is not None:
        return None
    if model_config is None or model_config.skip_tokenizer_init:
        return getattr(getattr(model_config, "hf_config", None), "bos_token_id", None)
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(model_config).bos_token_id
