# SPDX-License-Identifier: Apache-2.0
"""Start-up refusals of the chunk cache without an engine (issue 20, finding 5):
every set-up that used to fail at the first request with a message about
something else (or to serve other numbers) is refused by name at start-up.
The real config path of speculative decoding is in
tests/e2e/test_chunk_cache_startup.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from vllm.config import ChunkCacheConfig
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    check_attention_layer,
    check_config,
    kv_cache_block_size,
)


def _config(model=None, parallel=None, speculative=None):
    return SimpleNamespace(
        chunk_cache_config=ChunkCacheConfig(enable_chunk_cache=True),
        cache_config=SimpleNamespace(kv_offloading_size=None),
        kv_transfer_config=None,
        model_config=SimpleNamespace(
            **{
                "use_mla": False,
                "is_multimodal_model": False,
                "is_encoder_decoder": False,
                **(model or {}),
            }
        ),
        parallel_config=SimpleNamespace(
            **{
                "decode_context_parallel_size": 1,
                "prefill_context_parallel_size": 1,
                "enable_dbo": False,
                "ubatch_size": 0,
                **(parallel or {}),
            }
        ),
        speculative_config=speculative,
    )


def test_a_plain_decoder_config_passes():
    check_config(_config())


def test_sparse_mla_passes_on_the_npu_only(monkeypatch):
    # Issue 32: vllm-ascend's SFA has indexer key writers (checked per layer when the
    # worker builds it); vLLM's DSA (CUDA) has none and the CPU no sparse attention.
    from vllm.platforms import current_platform

    sparse = _config(
        model={"use_mla": True, "hf_config": SimpleNamespace(index_topk=2048)}
    )
    with pytest.raises(ValueError, match="sparse MLA.*DSA on CUDA.*SFA"):
        check_config(sparse)
    monkeypatch.setattr(type(current_platform), "device_name", "npu", raising=False)
    check_config(sparse)


def test_a_dense_mla_config_passes_its_backend_is_checked_by_the_worker():
    # DeepSeek-V2/V3 (issue 22): the latent data path exists for vLLM's CPU_MLA; other
    # MLA backends are refused by name when the worker registers the layers.
    check_config(_config(model={"use_mla": True, "hf_config": SimpleNamespace()}))


@pytest.mark.parametrize(
    "config, message",
    [
        (
            _config(
                model={"use_mla": True, "hf_config": SimpleNamespace(index_topk=2048)}
            ),
            "sparse MLA.*DeepSeek-V3.2's DSA.*vllm-ascend's SFA",
        ),
        (_config(model={"is_encoder_decoder": True}), "encoder-decoder"),
        (_config(model={"is_multimodal_model": True}), "multimodal"),
        # Issue 30, finding 3. Before: accepted; an embedding request with "##" was
        # split, its children (SamplingParams) spawned on the pooling runner, and
        # mean pooling covered the question only.
        (_config(model={"runner_type": "pooling"}), "does not support pooling models"),
        (
            _config(model={"hf_config": SimpleNamespace(no_rope_layers=[1, 0])}),
            "no_rope_layers",
        ),
        (_config(speculative=SimpleNamespace(method="eagle")), "speculative decoding"),
        (
            _config(parallel={"decode_context_parallel_size": 2}),
            "context parallelism.*--decode-context-parallel-size 2",
        ),
        (
            _config(parallel={"prefill_context_parallel_size": 2}),
            "context parallelism.*--prefill-context-parallel-size 2",
        ),
        (_config(parallel={"enable_dbo": True}), "dual-batch overlap"),
        (_config(parallel={"ubatch_size": 2}), "micro-batching"),
    ],
    ids=[
        "sparse-mla",
        "encoder-decoder",
        "multimodal",
        "pooling",
        "nope-layers",
        "speculative",
        "dcp",
        "pcp",
        "dbo",
        "ubatch",
    ],
)
def test_unsupported_set_ups_are_refused_by_name(config, message):
    # Before (finding 5): speculative decoding failed at the first step with
    # "layer not found", DCP/DBO while serving, encoder-decoder not at all.
    with pytest.raises(ValueError, match=message):
        check_config(config)


# ------------------------------------------------------- KV cache layout


def _kv_cache_config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"l{i}"], spec) for i, spec in enumerate(specs)
        ],
    )


def _spec(kind="full", **extra):
    from vllm.v1 import kv_cache_interface as kvi

    common = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    if kind == "sliding":
        return kvi.SlidingWindowSpec(sliding_window=32, **common)
    if kind == "chunked":
        return kvi.ChunkedLocalAttentionSpec(attention_chunk_size=32, **common)
    return kvi.FullAttentionSpec(**common, **extra)


def test_one_group_of_full_attention_gives_its_block_size():
    assert kv_cache_block_size(_kv_cache_config(_spec())) == 16


def test_windows_kept_as_full_attention_or_on_every_layer_are_served():
    """Issue 42: sliding layers kept as full attention (hybrid allocator off: every
    block kept, each kernel applies its window by position) are served (Gemma 2 / 3
    in the family matrix); so is one group of sliding-window layers, whatever the
    window (vLLM's SlidingWindowManager frees only blocks out of every later
    token's window; Mistral with window 24 in the family matrix). Before: a
    SlidingWindowSpec below max_model_len was refused."""
    assert kv_cache_block_size(_kv_cache_config(_spec(sliding_window=32))) == 16
    assert kv_cache_block_size(_kv_cache_config(_spec("sliding"))) == 16


@pytest.mark.parametrize(
    "specs, message",
    [
        (
            (_spec("chunked"),),
            r"the KV cache of layer\(s\) l0 is ChunkedLocalAttentionSpec, "
            r"chunk size 32 \(chunked-local attention restarts at absolute positions",
        ),
        ((_spec(), _spec("sliding")), "one KV cache group; this model has 2"),
    ],
    ids=["chunked-local", "two-groups"],
)
def test_other_kv_cache_layouts_are_refused(specs, message):
    with pytest.raises(ValueError, match=message):
        kv_cache_block_size(_kv_cache_config(*specs))


# ------------------------------------------------------ attention layers


def _attention(**attrs):
    from vllm.model_executor.layers.attention.attention import Attention

    layer = Attention.__new__(Attention)  # no engine config needed for the checks
    nn.Module.__init__(layer)
    layer.kv_sharing_target_layer_name = None
    layer.sliding_window = None
    for key, value in attrs.items():
        setattr(layer, key, value)
    return layer


def test_kv_sharing_layers_are_refused():
    # Before: key=None at the first child step (the layer computes no keys).
    layer = _attention(kv_sharing_target_layer_name="model.layers.0.self_attn.attn")
    with pytest.raises(ValueError, match="KV-sharing.*model.layers.0.self_attn.attn"):
        check_attention_layer("model.layers.3.self_attn.attn", layer)


# Stand-ins named as the backends' implementations (the checks go by class name).
CPUAttentionBackendImpl = type(
    "CPUAttentionBackendImpl", (), {"kv_cache_dtype": "auto"}
)
FlashAttentionImpl = type("FlashAttentionImpl", (), {"kv_cache_dtype": "auto"})
TritonAttentionImpl = type("TritonAttentionImpl", (), {"kv_cache_dtype": "auto"})
FlashInferImpl = type("FlashInferImpl", (), {"kv_cache_dtype": "auto"})


def test_sliding_window_layers_are_served_where_shown_exact():
    """Issue 42. Before: every windowed layer was refused, even Gemma 2's 4096
    on a 4096-token model. A window of at least max_model_len is full attention
    on any backend; a shorter one is served on CPU_ATTN (shown exact by the
    family matrix), on TRITON_ATTN (its kernel under Triton's interpreter, issue
    52: test_query_runs_triton_attn.py) and on TRITON_ATTN and FLASH_ATTN as run
    on an H200 (issue 52, docs/gpu.md), and refused elsewhere, naming the layer
    and the backend."""
    check_attention_layer(
        "l0", _attention(sliding_window=8, impl=CPUAttentionBackendImpl()), 4096
    )
    check_attention_layer(
        "l0", _attention(sliding_window=8, impl=TritonAttentionImpl()), 4096
    )
    check_attention_layer(
        "l0", _attention(sliding_window=8, impl=FlashAttentionImpl()), 4096
    )
    check_attention_layer(
        "l0", _attention(sliding_window=4096, impl=FlashInferImpl()), 4096
    )
    with pytest.raises(
        ValueError,
        match=r"sliding-window attention \(l0, window 4095\) on "
        "the attention backend FlashInferImpl",
    ):
        check_attention_layer(
            "l0", _attention(sliding_window=4095, impl=FlashInferImpl()), 4096
        )


def test_non_attention_layers_and_unknown_backends_are_refused():
    with pytest.raises(
        ValueError, match="standard attention layers only; l0 is Linear"
    ):
        check_attention_layer("l0", nn.Linear(2, 2))

    class OtherImpl:
        pass

    with pytest.raises(ValueError, match="attention backend of l0 \\(OtherImpl\\)"):
        check_attention_layer("l0", _attention(impl=OtherImpl()))
