# SPDX-License-Identifier: Apache-2.0
"""Start-up wiring of the chunk cache: connector selection and pool sizing."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_role="kv_both"
    )


def pool_num_blocks(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Blocks of the chunk pool (same answer in the scheduler and workers)."""
    cfg = vllm_config.chunk_cache_config
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        return 0
    spec = groups[0].kv_cache_spec
    block_size = spec.block_size
    if cfg.chunk_pool_size_gib is not None:
        num_layers = sum(len(g.layer_names) for g in groups)
        # Bytes one token takes in the pool: K and V rows of every layer.
        bytes_per_token = spec.page_size_bytes // block_size * num_layers
        tokens = int(cfg.chunk_pool_size_gib * (1 << 30)) // max(1, bytes_per_token)
    else:
        tokens = int(cfg.chunk_pool_fraction * kv_cache_config.num_blocks * block_size)
    return max(0, tokens // POOL_BLOCK_SIZE)
