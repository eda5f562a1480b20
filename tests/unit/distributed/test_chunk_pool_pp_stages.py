"""Chunk pool rows with pipeline stages of different sizes (issue 12).

Every worker sizes its pool from its own config and must get the rows of the
scheduler's allocator (whose config is rank 0's). With --chunk-pool-size-gib the
rows come from bytes per token; when the pipeline stages hold different numbers
of layers (VLLM_PP_LAYER_PARTITION="1,3", or vLLM's split of 30 layers over 4
stages: 7, 8, 8, 7), a stage with more layers than stage 0 got fewer rows, and
the first capture past them crashed the engine:
  IndexError: index_copy_(): index 688 is out of bounds for dimension 0 with size 688
(seen with tiny-llama, --pipeline-parallel-size 2, VLLM_PP_LAYER_PARTITION=1,3,
--chunk-pool-size-gib 0.001). Real ModelConfig / ParallelConfig, no engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import setup

from tests.conftest import models_dir


def _config(model_config, pp_size: int, rank: int, size_gib, fraction=0.15):
    from vllm.config import ParallelConfig

    parallel = ParallelConfig(pipeline_parallel_size=pp_size)
    parallel.rank = rank  # what each worker's copy of the config holds
    return SimpleNamespace(
        chunk_cache_config=SimpleNamespace(
            chunk_pool_fraction=fraction, chunk_pool_size_gib=size_gib
        ),
        model_config=model_config,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=parallel,
    )


@pytest.fixture(scope="module")
def tiny():
    from vllm.config import ModelConfig

    return ModelConfig(model=str(models_dir() / "tiny-llama"), dtype="float32")


@pytest.mark.parametrize(
    "partition,pp_size", [("1,3", 2), ("3,1", 2), (None, 2), ("1,1,2", 3)]
)
@pytest.mark.parametrize("size_gib", [0.001, None])
def test_every_stage_gets_the_schedulers_pool_rows(
    tiny, monkeypatch, partition, pp_size, size_gib
):
    if partition is None:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    else:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    num_kv_blocks, block_size = 1000, 128
    rows = [
        setup._pool_blocks(
            _config(tiny, pp_size, r, size_gib), num_kv_blocks, block_size
        )
        for r in range(pp_size)
    ]
    assert len(set(rows)) == 1, rows
    if size_gib is not None:
        # No stage's pool is larger than asked for: the biggest stage fills it.
        layers = [int(x) for x in (partition or "2,2").split(",")]
        per_token = max(layers) * 2 * 32 * 2 * 4  # tiny-llama: 2 KV heads x 32, fp32
        assert rows[0] * setup.POOL_BLOCK_SIZE * per_token <= size_gib * (1 << 30)
        assert (rows[0] + 1) * setup.POOL_BLOCK_SIZE * per_token > size_gib * (1 << 30)
