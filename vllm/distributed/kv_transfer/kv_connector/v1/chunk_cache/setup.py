# SPDX-License-Identifier: Apache-2.0
"""Start-up wiring of the chunk cache: connector selection and pool sizing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)

CONNECTOR_NAME = "ChunkCacheConnector"
# Rows per chunk-pool block (allocation granularity of the pool; independent
# of vLLM's paged block size).
POOL_BLOCK_SIZE = 16


def configure_chunk_cache_connector(vllm_config: VllmConfig) -> None:
    """Point kv_transfer_config at the chunk cache's connector."""
    from vllm.config import KVTransferConfig

    if vllm_config.cache_config.kv_offloading_size is not None:
        raise ValueError(
            "--enable-chunk-cache cannot be combined with --kv-offloading-size: "
            "both need vLLM's single KV connector slot"
        )
    current = vllm_config.kv_transfer_config
    if current is not None and current.kv_connector not in (None, CONNECTOR_NAME):
        raise ValueError(
            "--enable-chunk-cache cannot be combined with --kv-transfer-config "
            f"(connector {current.kv_connector!r}): the chunk cache uses vLLM's "
            "single KV connector slot"
        )
    model_config = vllm_config.model_config
    if model_config is not None:
        if getattr(model_config, "use_mla", False):
            raise ValueError(
                "--enable-chunk-cache does not support MLA attention (latent KV "
                "cannot be re-positioned by a RoPE rotation)"
            )
        if model_config.is_multimodal_model:
            raise ValueError(
                "--enable-chunk-cache does not support multimodal models yet "
                "(M-RoPE positions are not linear in the token index)"
            )
    vllm_config.chunk_cache_config.resolve_sink_token_id(_bos_token_id(vllm_config))
    logger.info("Chunk cache enabled: %s", vllm_config.chunk_cache_config.describe())
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_role="kv_both"
    )


def pool_num_blocks(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Blocks of the chunk pool (same answer in the scheduler and workers)."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        return 0
    return _pool_blocks(vllm_config, kv_cache_config.num_blocks, groups[0].kv_cache_spec.block_size)


def pool_num_blocks_from_config(vllm_config: VllmConfig) -> int | None:
    """The same number in the front end, from what the engine reported at
    start-up (num_gpu_blocks); None before the engine has started."""
    num_kv_blocks = vllm_config.cache_config.num_gpu_blocks
    if not num_kv_blocks:
        return None
    return _pool_blocks(vllm_config, num_kv_blocks, vllm_config.cache_config.block_size)


def _pool_blocks(vllm_config: VllmConfig, num_kv_blocks: int, block_size: int) -> int:
    cfg = vllm_config.chunk_cache_config
    if cfg.chunk_pool_size_gib is not None:
        tokens = int(cfg.chunk_pool_size_gib * (1 << 30)) // max(1, pool_bytes_per_token(vllm_config))
    else:
        tokens = int(cfg.chunk_pool_fraction * num_kv_blocks * block_size)
    return max(0, tokens // POOL_BLOCK_SIZE)


def pool_bytes_per_token(vllm_config: VllmConfig) -> int:
    """Bytes one token takes in the pool: K and V rows of every layer, in the
    model dtype (the dtype the worker allocates the pool in)."""
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    num_layers = model_config.get_num_layers(parallel_config)
    num_kv_heads = model_config.get_num_kv_heads(parallel_config)
    itemsize = torch.empty((), dtype=model_config.dtype).element_size()
    return num_layers * num_kv_heads * model_config.get_head_size() * 2 * itemsize


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
