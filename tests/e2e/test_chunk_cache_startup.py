"""Start-up checks of --enable-chunk-cache on the real config path (no engine):
conflicting options are refused with a message naming the reason (issue 4,
acceptance 3), and the flag selects the chunk cache's connector."""

from __future__ import annotations

import pytest

from tests.conftest import models_dir

MODEL = str(models_dir() / "tiny-llama")


def _config(**kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=MODEL, dtype="float32", enforce_eager=True, max_model_len=1024, **kwargs
    ).create_engine_config()


def test_flag_selects_the_chunk_cache_connector():
    config = _config(enable_chunk_cache=True)
    assert config.kv_transfer_config.kv_connector == "ChunkCacheConnector"
    assert config.kv_transfer_config.kv_role == "kv_both"


def test_another_kv_connector_is_refused():
    from vllm.config import KVTransferConfig

    with pytest.raises(
        ValueError, match="cannot be combined with --kv-transfer-config"
    ):
        _config(
            enable_chunk_cache=True,
            kv_transfer_config=KVTransferConfig(
                kv_connector="ExampleConnector", kv_role="kv_both"
            ),
        )


def test_the_chunk_cache_inside_a_multi_connector_is_refused_by_name():
    # The chunk cache owns vLLM's connector slot: next to another connector in a
    # MultiConnector, that one would load or save a chunked prompt's blocks as if they
    # were causal KV. Refused at start-up, naming the MultiConnector.
    from vllm.config import KVTransferConfig

    with pytest.raises(ValueError, match="connector 'MultiConnector'"):
        _config(
            enable_chunk_cache=True,
            kv_transfer_config=KVTransferConfig(
                kv_connector="MultiConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "connectors": [
                        {"kv_connector": "ChunkCacheConnector", "kv_role": "kv_both"},
                        {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
                    ]
                },
            ),
        )


@pytest.mark.parametrize(
    "given, named",
    [
        (dict(kv_load_failure_policy="recompute"), "kv_load_failure_policy"),
        (dict(kv_connector="ChunkCacheConnector", kv_role="kv_producer"), "kv_role"),
        (
            dict(
                kv_connector="ChunkCacheConnector",
                kv_role="kv_both",
                kv_connector_extra_config={"pool": 1},
            ),
            "kv_connector_extra_config",
        ),
    ],
)
def test_a_kv_transfer_setting_the_chunk_cache_would_drop_is_refused(given, named):
    # The chunk cache writes vLLM's whole KV transfer config itself: a setting given
    # with it would be lost without a word, so it is refused by name.
    from vllm.config import KVTransferConfig

    with pytest.raises(
        ValueError, match=f"--kv-transfer-config's {named} would be ignored"
    ):
        _config(enable_chunk_cache=True, kv_transfer_config=KVTransferConfig(**given))


def test_naming_the_chunk_cache_connector_alone_is_accepted():
    from vllm.config import KVTransferConfig

    config = _config(
        enable_chunk_cache=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="ChunkCacheConnector", kv_role="kv_both"
        ),
    )
    assert config.kv_transfer_config.kv_connector == "ChunkCacheConnector"


def test_kv_offloading_is_refused():
    with pytest.raises(
        ValueError, match="cannot be combined with --kv-offloading-size"
    ):
        _config(enable_chunk_cache=True, kv_offloading_size=1.0)


def test_unsupported_rope_types_are_refused_by_name():
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.layer_ropes import (
        find_layer_ropes,
    )
    from vllm.model_executor.layers.rotary_embedding.dual_chunk_rope import (
        DualChunkRotaryEmbedding,
    )
    from vllm.v1.worker.position_remapper import RopeRotation

    # The rope type check the worker runs on every layer's rope at start-up.
    rope = DualChunkRotaryEmbedding.__new__(DualChunkRotaryEmbedding)
    torch.nn.Module.__init__(rope)
    with pytest.raises(ValueError, match="DualChunkRotaryEmbedding"):
        RopeRotation(rope)
    # A model without attention layers maps nothing.
    assert find_layer_ropes(torch.nn.Linear(2, 2)) == ({}, [])


def test_speculative_decoding_is_refused_at_start_up():
    # Before (issue 20, finding 5): accepted here; with a drafter (EAGLE/MTP)
    # the first step failed with "layer not found", with n-gram the drafts
    # were verified against chunks nobody loaded into the drafter's view.
    with pytest.raises(ValueError, match="does not support speculative decoding"):
        _config(
            enable_chunk_cache=True,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 2,
            },
        )


def test_a_pooling_runner_is_refused_at_start_up():
    # Issue 30, finding 3. Before: accepted; an embedding request with "##" was split
    # into children (SamplingParams) on a pooling runner, and the pooled output saw the
    # question only.
    with pytest.raises(ValueError, match="does not support pooling models"):
        _config(enable_chunk_cache=True, runner="pooling")
