# SPDX-License-Identifier: Apache-2.0
"""The store key holds the rotation vLLM built, not only the HF rope fields
(issue 50, finding 2).

A Phi-3-style LongRoPE model (original 512, max 4096) rotates its keys with the
short factors at --max-model-len <= 512 and with the long ones above: the same
HF config, other K. Two replicas that differ so must never share entries; two
whose rotation is the same must.

The oracle is vLLM's own rope: each engine's rope rotates the same raw keys at
the same positions, and the keys of two engines must be equal exactly when
those rotated keys are (bit for bit). The key is never compared with itself.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.keys import (
    StoreNamespace,
    store_key,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.rank import (
    StoreRank,
)

from tests.unit.distributed.test_chunk_cache_worker import _attention

HEAD = 64
ORIGINAL, MAX_POS = 512, 4096
SHORT = [1.0 + 0.01 * i for i in range(HEAD // 2)]
LONG = [1.0 + 0.5 * i for i in range(HEAD // 2)]
HF_SCALING = {
    "type": "longrope",
    "short_factor": SHORT,
    "long_factor": LONG,
    "original_max_position_embeddings": ORIGINAL,
}


class Block(nn.Module):
    def __init__(self, rope, attn):
        super().__init__()
        self.rotary_emb = rope
        self.attn = attn

    def forward(self, positions, q, k):
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k)


def _config(max_model_len: int):
    from vllm.config import VllmConfig

    config = VllmConfig()
    hf = types.SimpleNamespace(
        rope_theta=10000.0,
        rope_scaling=dict(HF_SCALING),
        rope_parameters=None,
        partial_rotary_factor=None,
        max_position_embeddings=MAX_POS,
    )
    config.model_config = types.SimpleNamespace(
        max_model_len=max_model_len, hf_text_config=hf, served_model_name="tiny-phi3"
    )
    config.chunk_cache_config = types.SimpleNamespace(max_chunk_tokens=256)
    return config


def _longrope(max_model_len: int):
    """VLLM's LongRoPE as its Phi-3 model builds it under `--max-model-len`.
    NOTE: built directly, not through get_rope, whose cache (keyed by the rope
    parameters, not max_model_len) would hand back the first one built."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import (
        Phi3LongRoPEScaledRotaryEmbedding,
    )

    with set_current_vllm_config(_config(max_model_len)):
        return Phi3LongRoPEScaledRotaryEmbedding(
            HEAD, HEAD, MAX_POS, ORIGINAL, 10000.0, True, torch.float32, SHORT, LONG
        )


@pytest.fixture
def one_rank(monkeypatch):
    from vllm.distributed import parallel_state

    group = types.SimpleNamespace(rank_in_group=0)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: group)


def _engine(max_model_len: int, layers: int = 2):
    """(the rank's StoreRank, its rope) for an engine at `max_model_len`."""
    from vllm.config import set_current_vllm_config

    rope = _longrope(max_model_len)
    model = nn.ModuleList(
        [Block(rope, _attention(f"model.layers.{i}.attn")) for i in range(layers)]
    )
    config = _config(max_model_len)
    config.parallel_config.tensor_parallel_size = 1
    config.parallel_config.pipeline_parallel_size = 1
    with set_current_vllm_config(config):
        return StoreRank.from_engine(config, model), rope


def _key(rank: StoreRank) -> str:
    ns = StoreNamespace(
        model=rank.model,
        weights_version="w",
        kv_dtype="float32",
        kv_layout="l",
        rope=rank.rope,
        compute=rank.compute,
        tp_rank=rank.tp_rank,
        tp_size=rank.tp_size,
        pp_rank=rank.pp_rank,
        pp_size=rank.pp_size,
        cache_salt=None,
        lora=None,
    )
    return store_key(ns, 0x1234)


def _rotated(rope) -> torch.Tensor:
    """VLLM's rope applied to fixed raw keys at positions 0..255 (what a child
    computed there would store)."""
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(256, HEAD, generator=gen)
    forward = getattr(rope, "forward_native", rope.forward)
    _, out = forward(torch.arange(256), key.clone(), key.clone())
    return out


@pytest.mark.parametrize(
    "a, b",
    [(512, 4096), (256, 32768), (512, 513), (2048, 4096), (513, 32768), (128, 512)],
)
def test_the_key_differs_exactly_when_the_rotation_does(one_rank, a, b):
    rank_a, rope_a = _engine(a)
    rank_b, rope_b = _engine(b)
    # NOTE: both engines read the same HF config (_config): only max_model_len differs.
    same_k = torch.equal(_rotated(rope_a), _rotated(rope_b))
    # The cases do cover both sides of LongRoPE's switch (oracle sanity).
    assert same_k == ((a > ORIGINAL) == (b > ORIGINAL))
    same_key = _key(rank_a) == _key(rank_b)
    assert same_key == same_k, (
        f"max_model_len {a} vs {b}: vLLM's rope gives "
        f"{'the same' if same_k else 'other'} K, but the store keys are "
        f"{'equal' if same_key else 'different'}"
    )


def test_rope_names_the_factors_magnitude_and_cache_half_used(one_rank):
    """`rope` captures the effective configuration: what each layer's keys were
    rotated with, read from the rope as built (not recomputed from the config)."""
    short, short_rope = _engine(512)
    long, long_rope = _engine(4096)
    assert not short_rope.use_long_rope and long_rope.use_long_rope
    for rank, rope, offset, mscale in (
        (short, short_rope, 0, short_rope.short_mscale),
        (long, long_rope, ORIGINAL, long_rope.long_mscale),
    ):
        built = json.loads(rank.rope)["built"]
        assert len(built["ropes"]) == 1  # both layers share the rope
        assert built["layers"] == {"model.layers.0.attn": 0, "model.layers.1.attn": 0}
        identity = json.loads(built["ropes"][0])
        assert identity["cache_offset"] == offset
        assert float.fromhex(identity["magnitude"]) == pytest.approx(mscale)
        assert identity["type"] == "Phi3LongRoPEScaledRotaryEmbedding"
        assert identity["rotary_dim"] == HEAD and identity["neox"] is True


def test_which_rope_each_layer_used_is_in_the_key(one_rank):
    """Two models with the same set of ropes, used by other layers (a
    local/global layout), rotate a layer's keys differently: other keys."""
    from vllm.config import set_current_vllm_config

    short, long = _longrope(512), _longrope(4096)
    config = _config(4096)
    config.parallel_config.tensor_parallel_size = 1
    config.parallel_config.pipeline_parallel_size = 1

    def rank_of(ropes):
        model = nn.ModuleList(
            [
                Block(r, _attention(f"model.layers.{i}.attn"))
                for i, r in enumerate(ropes)
            ]
        )
        with set_current_vllm_config(config):
            return StoreRank.from_engine(config, model)

    assert _key(rank_of([short, long])) != _key(rank_of([long, short]))
    assert _key(rank_of([short, long])) == _key(rank_of([short, long]))


def test_compute_names_the_backend_each_layer_was_given(one_rank):
    """`compute` captures the effective configuration too: the attention backend
    vLLM gave the layers (what computed the KV), read from the built layers, not
    from a flag. The oracle is the backend classes attached to the layers: engines
    whose layers run other backends never share keys, engines with the same do."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend

    rope = _longrope(512)
    config = _config(512)
    config.parallel_config.tensor_parallel_size = 1
    config.parallel_config.pipeline_parallel_size = 1

    def rank_with(*backends):
        model = nn.ModuleList()
        for i, backend in enumerate(backends):
            block = Block(rope, _attention(f"model.layers.{i}.attn"))
            block.attn.attn_backend = backend
            model.append(block)
        with set_current_vllm_config(config):
            return StoreRank.from_engine(config, model)

    cpu = rank_with(CPUAttentionBackend, CPUAttentionBackend)
    flex = rank_with(FlexAttentionBackend, FlexAttentionBackend)
    assert json.loads(cpu.compute)["backends"] == [CPUAttentionBackend.get_name()]
    assert json.loads(flex.compute)["backends"] == [FlexAttentionBackend.get_name()]
    assert _key(cpu) != _key(flex)
    assert _key(cpu) == _key(rank_with(CPUAttentionBackend, CPUAttentionBackend))
    assert _key(rank_with(CPUAttentionBackend, FlexAttentionBackend)) not in (
        _key(cpu),
        _key(flex),
    )
