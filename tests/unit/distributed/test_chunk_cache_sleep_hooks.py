# SPDX-License-Identifier: Apache-2.0
"""The chunk cache under vLLM 0.33's sleep-mode hooks, and the 0.33 changes of the
block hashing it relies on, without an engine.

vLLM 0.33's worker calls `unregister_kv_caches()` before a sleep or a discard of the
KV cache memory and `restore_kv_caches()` after the wake-up; the chunk pool lives in
that memory. The scheduler side forgets every entry in the same pause (vLLM resets the
connector's cache when it pauses for a sleep), so the worker only records that the
pool is gone and refuses a step that would read or write it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.connector import (
    ChunkCacheConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
    ChildStore,
    ChunkCacheMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.worker import (
    ChunkCacheWorker,
)

SLEEP_HOOKS = ("unregister_kv_caches", "restore_kv_caches")
HAS_SLEEP_HOOKS = all(hasattr(KVConnectorBase_V1, h) for h in SLEEP_HOOKS)
needs_sleep_hooks = pytest.mark.skipif(
    not HAS_SLEEP_HOOKS,
    reason="this vLLM's KV connector base has no sleep-mode hooks "
    "(unregister_kv_caches, restore_kv_caches: vLLM 0.33 added them)",
)


def _worker() -> ChunkCacheWorker:
    chunk = SimpleNamespace(
        chunk_pool_fraction=0.15,
        chunk_pool_size_gib=None,
        max_chunk_load_tokens=64,
        chunk_store=None,
        chunk_recompute_tokens=0,
    )
    vllm_config = SimpleNamespace(
        chunk_cache_config=chunk,
        model_config=SimpleNamespace(dtype=torch.float32),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        compilation_config=SimpleNamespace(),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
    )
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=4))
    worker = ChunkCacheWorker(
        vllm_config, SimpleNamespace(kv_cache_groups=[group], num_blocks=64)
    )
    worker.pool_key["l0"] = torch.zeros(64, 1, 2)
    worker.pool_value["l0"] = torch.zeros(64, 1, 2)
    return worker


def _a_step_that_stores() -> ChunkCacheMetadata:
    store = ChildStore(
        block_ids=(2,),
        pool_block_ids=(1,),
        first_position=0,
        end_position=4,
        store_start=0,
    )
    return ChunkCacheMetadata(stores=[store])


def _connector_of(worker: ChunkCacheWorker) -> ChunkCacheConnector:
    # NOTE: the worker role's connector without vLLM's engine config: only its
    # worker is read by the hooks under test.
    connector = ChunkCacheConnector.__new__(ChunkCacheConnector)
    connector._scheduler = None
    connector._worker = worker
    return connector


def test_a_step_while_the_pool_is_released_is_refused_until_the_restore():
    worker = _worker()
    connector = _connector_of(worker)
    connector.unregister_kv_caches()
    assert not worker.pool_resident
    # A step that neither loads nor stores reads nothing of the pool.
    worker.start_load_kv(ChunkCacheMetadata(), None)
    worker.capture_after_forward(ChunkCacheMetadata())
    with pytest.raises(RuntimeError, match="KV cache memory is released"):
        worker.capture_after_forward(_a_step_that_stores())
    # Both hooks are idempotent, as vLLM's base class asks.
    connector.unregister_kv_caches()
    connector.restore_kv_caches()
    connector.restore_kv_caches()
    assert worker.pool_resident
    worker.capture_after_forward(_a_step_that_stores())


def test_the_scheduler_role_has_no_pool_to_release():
    connector = ChunkCacheConnector.__new__(ChunkCacheConnector)
    connector._scheduler, connector._worker = None, None
    connector.unregister_kv_caches()
    connector.restore_kv_caches()


@needs_sleep_hooks
def test_on_this_vllm_the_connector_answers_the_sleep_hooks_itself():
    for hook in SLEEP_HOOKS:
        assert getattr(ChunkCacheConnector, hook) is not getattr(
            KVConnectorBase_V1, hook
        ), hook
    # vLLM refuses sleep mode for a connector that says it cannot follow the
    # KV cache's remap; the chunk cache can (the base class's answer).
    assert ChunkCacheConnector.supports_sleep_mode(SimpleNamespace()) is True


@needs_sleep_hooks
def test_with_the_chunk_cache_the_block_hashes_look_no_tokens_ahead():
    """VLLM 0.33 may hash tokens after each block (num_hash_lookahead_tokens,
    EAGLE's block drop); with a KV transfer config it keeps the legacy hashes,
    and --enable-chunk-cache sets one: the chunk cache's block keys cover
    exactly the blocks' own tokens."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.config.chunk_cache import ChunkCacheConfig

    # NOTE: the device named: vLLM's CUDA wheel without a GPU infers none.
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        chunk_cache_config=ChunkCacheConfig(
            enable_chunk_cache=True, chunk_context="none"
        ),
    )
    assert config.kv_transfer_config is not None
    assert config.kv_transfer_config.kv_connector == "ChunkCacheConnector"
    # What would turn the lookahead on without a connector.
    config.speculative_config = SimpleNamespace(
        use_eagle_block_drop=lambda: True, disable_lookahead_block_hashes=False
    )
    config.cache_config.enable_prefix_caching = True
    assert config.num_hash_lookahead_tokens == 0
