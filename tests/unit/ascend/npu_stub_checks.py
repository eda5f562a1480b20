"""Checks of the fork's Ascend code path on CPU, run in a subprocess by
test_ascend_stubbed.py with the stub `torch_npu` (tests/unit/ascend/stubs) and the
patched, materialised vllm-ascend tree on PYTHONPATH. Labelled for what they are:
they run the fork's and vllm-ascend's Python code (registration, DeviceOperator
dispatch, the remapper) against CPU reference implementations of two NPU ops, so
they check index and layout math, not the NPU ops.

    python npu_stub_checks.py CHECK_NAME
"""

from __future__ import annotations

import sys
import types

import torch

# vllm-ascend reads its build's SoC from a generated module; A2 here (A5 is
# exercised by swapping the adaptor class below).
_build_info = types.ModuleType("vllm_ascend._build_info")
_build_info.__device_type__ = "A2"
sys.modules["vllm_ascend._build_info"] = _build_info


def _device_op():
    import vllm_ascend
    import vllm_ascend.ops  # noqa: F401 - device_op is imported through ops first
    from vllm_ascend.device import device_op

    vllm_ascend._build_info = _build_info
    return device_op


def check_registration_covers_standard_attention_mla_and_sfa_only() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import cache_writers
    from vllm_ascend.distributed.kv_transfer import register_connector

    register_connector()  # the patched plugin entry point
    named = lambda n: type(n, (), {})()  # noqa: E731 - an instance of a class named n
    writer = cache_writers.writer_for(named("AscendAttentionBackendImpl"))
    assert writer is not None and writer.backend == "ASCEND", writer
    assert cache_writers.latent_writer_for(named("AscendAttentionBackendImpl")) is None
    latent = cache_writers.latent_writer_for(named("AscendMLAImpl"))
    assert latent is not None and latent.backend == "ASCEND_MLA", latent
    assert cache_writers.writer_for(named("AscendMLAImpl")) is None
    # Exactly these two from vllm-ascend (the rest are vLLM's own).
    from vllm_ascend.distributed import chunk_cache_npu

    ours = {
        name
        for name, w in {
            **cache_writers._WRITERS,
            **cache_writers._LATENT_WRITERS,
        }.items()
        if w.write.__module__ == chunk_cache_npu.__name__
    }
    assert ours == {"AscendAttentionBackendImpl", "AscendMLAImpl", "AscendSFAImpl"}, (
        ours
    )
    # SFA (issue 32): a latent writer and an indexer key writer, nothing else.
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import (
        indexer_keys_layers,
    )

    assert set(indexer_keys_layers._INDEXER_WRITERS) == {"AscendSFAImpl"}
    assert cache_writers.writer_for(named("AscendSFAImpl")) is None
    for refused in ("AscendDSAImpl", "AscendMlaCPImpl", "AscendC8AttentionBackendImpl"):
        assert cache_writers.writer_for(named(refused)) is None, refused
        assert cache_writers.latent_writer_for(named(refused)) is None, refused
        assert indexer_keys_layers.indexer_writer_for(named(refused)) is None, refused


def check_load_path_writes_rotated_rows_through_device_operator() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.position_remapper import (
        PositionRemapper,
        RemapRows,
        RopeRotation,
    )
    from vllm_ascend.distributed.chunk_cache_npu import write_rows_npu

    device_op = _device_op()
    heads, dim, block_size, num_blocks = 2, 64, 128, 4  # NPU block size 128
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(dim, 4096, True, {"rope_type": "default"}, torch.float32)
    rotation = RopeRotation(rope)
    gen = torch.Generator().manual_seed(0)
    raw_k = torch.randn(10, heads * dim, generator=gen)
    stored_pos = torch.arange(1, 11)  # a chunk computed after its sink
    _, pool_k = rope.forward_native(stored_pos, raw_k.clone(), raw_k.clone())
    pool_k = pool_k.view(10, heads, dim)
    pool_v = torch.randn(10, heads, dim, generator=gen)
    real_pos = torch.arange(300, 310)  # its place in the request
    _, want_k = rope.forward_native(real_pos, raw_k.clone(), raw_k.clone())
    slots = torch.tensor([2 * block_size + 44 + i for i in range(10)])

    for adaptor in (device_op.BaseDeviceAdaptor, device_op.A5DeviceAdaptor):
        device_op.DeviceOperator = adaptor  # A2/A3, then A5
        key_cache = torch.zeros(num_blocks, block_size, heads, dim)
        value_cache = torch.zeros(num_blocks, block_size, heads, dim)
        layer = types.SimpleNamespace(kv_cache=[key_cache, value_cache])
        remapper = PositionRemapper(
            rotation,
            lambda name, k, v, s, layer=layer: write_rows_npu(layer, k, v, s, None),
        )
        rows = RemapRows(
            src_rows=torch.arange(10), dst_slots=slots, deltas=torch.full((10,), 299)
        )
        remapper.remap_layer("layer.0", pool_k, pool_v, rows)
        got_k = key_cache[2, 44:54]
        got_v = value_cache[2, 44:54]
        assert torch.allclose(got_k, want_k.view(10, heads, dim), atol=1e-4), adaptor
        assert torch.equal(got_v, pool_v), adaptor
        untouched = torch.ones(num_blocks, block_size, dtype=torch.bool)
        untouched[2, 44:54] = False
        assert key_cache[untouched].abs().sum() == 0, "rows written outside their slots"


RANK, ROPE, MLA_BLOCK, MLA_BLOCKS = 512, 64, 128, 4  # DeepSeek-V3's row, NPU block 128
DEEPSEEK_YARN = {
    "rope_type": "deepseek_yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}


def _ascend_config(**flags):
    import vllm_ascend.ascend_config as ascend_config

    config = types.SimpleNamespace(
        **{"enable_kv_nz": False, "enable_mlapo": False, **flags}
    )
    ascend_config.get_ascend_config = lambda: config


def _mla_impl(gamma: torch.Tensor):
    """An AscendMLAImpl with what its cache write reads (its __init__ needs an NPU
    model config)."""
    from vllm_ascend.attention.mla_v1 import AscendMLAImpl

    impl = AscendMLAImpl.__new__(AscendMLAImpl)
    impl.num_kv_heads, impl.kv_lora_rank, impl.qk_rope_head_dim = 1, RANK, ROPE
    impl.enable_kv_nz = impl.enable_mlapo = impl.fa_quant_layer = False
    impl.kv_a_layernorm = types.SimpleNamespace(weight=gamma, variance_epsilon=1e-6)
    return impl


def _mla_cache(dtype):
    return (
        torch.zeros(MLA_BLOCKS, MLA_BLOCK, 1, RANK, dtype=dtype),
        torch.zeros(MLA_BLOCKS, MLA_BLOCK, 1, ROPE, dtype=dtype),
    )


def _ascend_cos_sin(rope, positions):
    """cos/sin as vllm-ascend hands them to its MLA ops: [n, 1, 1, rope], each
    frequency twice (cat(freqs, freqs)), the magnitude baked in."""
    cos, sin = rope.cos_sin_cache[positions].float().chunk(2, dim=-1)
    return (
        torch.cat((cos, cos), -1)[:, None, None],
        torch.cat((sin, sin), -1)[:, None, None],
    )


def _deepseek_rotation():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.position_remapper import RopeRotation

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            ROPE,
            max_position=4096,
            rope_parameters=dict(DEEPSEEK_YARN),
            is_neox_style=False,
            dtype=torch.float32,
        )
    return RopeRotation(rope)


def _ascend_ropes():
    """vllm-ascend's rope classes as vLLM's `get_rope` builds them on an NPU:
    vllm-ascend's own `register_ascend_customop` registers them as out-of-tree
    ops, and vLLM's CustomOp dispatch instantiates them in place of vLLM's.
    Returns {name: (rope, vLLM parent class)}. NOTE: on CPU, with one stand-in:
    `NPUPlatform.device_type` is "cpu" (AscendDeepseekScalingRotaryEmbedding
    builds its cache on that device; "npu" does not exist here)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding as vllm_rope
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm_ascend.platform import NPUPlatform
    from vllm_ascend.utils import register_ascend_customop

    _device_op()
    NPUPlatform.device_type = "cpu"
    config = VllmConfig()
    ropes = {}
    with set_current_vllm_config(config):
        # (it reads model_config.is_deepseek_mla alone; VllmConfig() has none)
        register_ascend_customop(
            types.SimpleNamespace(
                model_config=types.SimpleNamespace(is_deepseek_mla=False)
            )
        )
        for name, dim, neox, params, parent in (
            ("default", 64, True, {"rope_type": "default"}, vllm_rope.RotaryEmbedding),
            (
                "default_gptj",
                64,
                False,
                {"rope_type": "default"},
                vllm_rope.RotaryEmbedding,
            ),
            (
                "yarn",
                64,
                True,
                {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 1024,
                },
                vllm_rope.YaRNScalingRotaryEmbedding,
            ),
            (
                "deepseek_yarn",
                ROPE,
                False,
                dict(DEEPSEEK_YARN),
                vllm_rope.DeepseekScalingRotaryEmbedding,
            ),
        ):
            rope = get_rope(
                dim,
                max_position=4096,
                is_neox_style=neox,
                rope_parameters=dict(params),
                dtype=torch.float32,
            )
            ropes[name] = (rope, parent)
    return ropes


def _ascend_k(name: str, rope, raw_k, pos):
    """K at `pos` by the Ascend rope class's forward (q is needed too)."""
    n, heads, dim = raw_k.shape
    if name == "deepseek_yarn":
        _, k = rope.forward(pos, raw_k.clone(), raw_k.clone())
    else:
        _, k = rope.forward_oot(
            pos, raw_k.clone().view(n, -1), raw_k.clone().view(n, -1)
        )
    return k.reshape(n, heads, dim)


def _parent_k(name: str, rope, parent, raw_k, pos):
    """K at `pos` by vLLM's own rope math for these parameters: the parent's cache
    method and forward on the Ascend rope's attributes."""
    n, heads, dim = raw_k.shape
    vllm_rope = parent.forward_static(
        pos,
        raw_k.clone(),
        raw_k.clone(),
        dim,
        rope.rotary_dim,
        parent._compute_cos_sin_cache(rope),
        rope.is_neox_style,
    )[1]
    k = vllm_rope.view(n, heads, dim)
    if name == "deepseek_yarn":  # the layout Ascend's forward stores
        k = torch.cat((k[..., 0::2], k[..., 1::2]), -1)
    return k


def check_ascend_ropes_registered_and_keys_move_as_at_the_new_position() -> None:
    """The rope classes vLLM builds on an NPU (AscendRotaryEmbedding,
    AscendYaRNRotaryEmbedding, AscendDeepseekScalingRotaryEmbedding) are
    refused by RopeRotation until the patched plugin hook registers them, then
    accepted; K made by the Ascend rope's own forward at p (vllm-ascend's
    rope_forward_oot through the stub `_npu_rotary_embedding`; DeepSeek's
    forward de-interleaves GPT-J keys first), loaded at p + d through the
    remapper and write_rows_npu, equals K made by the same forward at p + d,
    and the parent vLLM rope's K at p + d in the layout that forward stores.
    Unregistered: AscendMRotaryEmbedding and the 310P rope stay refused."""
    from vllm.utils.torch_utils import vllm_lib
    from vllm.v1.worker.position_remapper import (
        PositionRemapper,
        RemapRows,
        RopeRotation,
    )
    from vllm_ascend.distributed.chunk_cache_npu import write_rows_npu
    from vllm_ascend.distributed.kv_transfer import register_connector
    from vllm_ascend.ops.rotary_embedding import rope_forward_oot

    ropes = _ascend_ropes()
    expected = {
        "default": "AscendRotaryEmbedding",
        "default_gptj": "AscendRotaryEmbedding",
        "yarn": "AscendYaRNRotaryEmbedding",
        "deepseek_yarn": "AscendDeepseekScalingRotaryEmbedding",
    }
    for name, (rope, _) in ropes.items():
        assert type(rope).__name__ == expected[name], (name, type(rope))
        try:
            RopeRotation(rope)
        except ValueError as e:
            assert type(rope).__name__ in str(e), str(e)
        else:
            raise AssertionError(f"{type(rope).__name__} accepted before registration")
    register_connector()  # the patched plugin entry point, as in every process
    # vllm-ascend registers its rope op for the NPU dispatch key only: the same
    # Python function on CPU tensors (it calls the stub _npu_rotary_embedding).
    vllm_lib.impl("npu_rotary_embedding", rope_forward_oot, "CPU")
    # Stand-in of Ascend's forward context, which forward_oot reads (no draft
    # model, no flash-comm all-gather of positions).
    import vllm_ascend.ops.rotary_embedding as ascend_rope

    ascend_rope._EXTRA_CTX = types.SimpleNamespace(
        is_draft_model=False, flash_comm_v1_enabled=False
    )
    device_op = _device_op()
    gen = torch.Generator().manual_seed(0)
    heads, n, block_size = 2, 12, 128
    for name, (rope, parent) in ropes.items():
        rotation = RopeRotation(rope)
        dim = rope.head_size
        neox_stored = name != "default_gptj"  # DeepSeek's forward stores halves
        assert rotation.is_neox_style is neox_stored, name
        raw_k = torch.randn(n, heads, dim, generator=gen)
        p = torch.randint(0, 2000, (n,), generator=gen)
        d = torch.randint(-2000, 2000, (n,), generator=gen).clamp(min=-p)

        stored = _ascend_k(name, rope, raw_k, p)
        want = _ascend_k(name, rope, raw_k, p + d)
        assert torch.allclose(
            want, _parent_k(name, rope, parent, raw_k, p + d), atol=1e-5
        ), name
        slots = torch.randperm(4 * block_size, generator=gen)[:n]
        for adaptor in (device_op.BaseDeviceAdaptor, device_op.A5DeviceAdaptor):
            device_op.DeviceOperator = adaptor
            key_cache = torch.zeros(4, block_size, heads, dim)
            value_cache = torch.zeros(4, block_size, heads, dim)
            layer = types.SimpleNamespace(kv_cache=[key_cache, value_cache])
            remapper = PositionRemapper(
                rotation,
                lambda _, k, v, s, layer=layer: write_rows_npu(layer, k, v, s, None),
            )
            remapper.remap_layer(
                "l0",
                stored,
                torch.zeros_like(stored),
                RemapRows(torch.arange(n), slots, d),
            )
            got = key_cache[slots // block_size, slots % block_size]
            # fp32 cos/sin caches at positions up to 4000 on both sides
            assert torch.allclose(got, want, atol=1e-3), (
                name,
                adaptor,
                (got - want).abs().max(),
            )
            assert (stored - want).abs().max() > 0.1  # the check can fail
        if name == "deepseek_yarn":
            # The pairing matters: the rope's own style (GPT-J) would be wrong.
            gptj = rotation.with_pairing(False).rotate(stored, d)
            assert (gptj - want).abs().max() > 0.1

    from vllm.v1.worker import position_remapper
    from vllm_ascend._310p.ops.rotary_embedding import AscendRotaryEmbedding310
    from vllm_ascend.ops.rotary_embedding import AscendMRotaryEmbedding

    for refused in (AscendRotaryEmbedding310, AscendMRotaryEmbedding):
        assert refused not in position_remapper._FREQUENCY_RULES, refused
    rope310 = AscendRotaryEmbedding310.__new__(AscendRotaryEmbedding310)
    try:
        RopeRotation(rope310)
    except ValueError as e:
        assert "AscendRotaryEmbedding310" in str(e), str(e)
    else:
        raise AssertionError("AscendRotaryEmbedding310 accepted")


def check_mla_load_with_ascend_deepseek_rope() -> None:
    """The MLA check below with the rope vLLM builds on an NPU,
    AscendDeepseekScalingRotaryEmbedding: its rotation pairs halves (its
    forward's layout) and LatentLayer switches it to the reader's GPT-J rows."""
    from vllm_ascend.distributed.kv_transfer import register_connector

    rope = _ascend_ropes()["deepseek_yarn"][0]
    register_connector()
    check_mla_load_writes_what_ascend_writes_at_the_new_position(rope)


def check_mla_load_writes_what_ascend_writes_at_the_new_position(rope=None) -> None:
    """A child's rows written by AscendMLAImpl's own prefill cache write (stub of
    npu_kv_rmsnorm_rope_cache), captured through the registered reader, loaded at
    p + d through LatentLayer (kv_c copied, k_pe rotated by d) and the registered
    writer (_npu_reshape_and_cache / npu_scatter_pa_kv_cache stubs): the cache then
    holds what AscendMLAImpl's write of the same tokens at p + d holds."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        latent_writer_for,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.mla_latent_layers import (  # noqa: E501
        LatentLayer,
    )
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.position_remapper import RemapRows, RopeRotation
    from vllm_ascend.distributed.chunk_cache_npu import register_npu_chunk_cache

    device_op = _device_op()
    _ascend_config()
    register_npu_chunk_cache()
    if rope is None:
        with set_current_vllm_config(VllmConfig()):
            rope = get_rope(
                ROPE,
                max_position=4096,
                rope_parameters=dict(DEEPSEEK_YARN),
                is_neox_style=False,
                dtype=torch.float32,
            )
    rotation = RopeRotation(rope)
    gen = torch.Generator().manual_seed(0)
    n = 20
    gamma = torch.rand(RANK, generator=gen) + 0.5
    impl = _mla_impl(gamma)
    layer = types.SimpleNamespace(impl=impl, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    kv_no_split = torch.randn(n, RANK + ROPE, generator=gen)
    p = torch.randint(0, 1500, (n,), generator=gen)
    d = torch.randint(-1500, 1500, (n,), generator=gen).clamp(min=-p)
    child_slots = torch.randperm(MLA_BLOCKS * MLA_BLOCK, generator=gen)[:n]
    real_slots = torch.tensor(
        [2 * MLA_BLOCK + 100 + i for i in range(n)]
    )  # crosses a block

    for adaptor in (device_op.BaseDeviceAdaptor, device_op.A5DeviceAdaptor):
        device_op.DeviceOperator = adaptor  # A2/A3, then A5
        cache = _mla_cache(torch.float32)
        impl.exec_kv_prefill(kv_no_split, *_ascend_cos_sin(rope, p), cache, child_slots)
        latent = LatentLayer.of(
            "l0",
            layer,
            cache,
            rotation,
            latent_writer_for(impl),
            num_rows=64,
            dtype=torch.float32,
        )
        pool_rows = torch.arange(n) + 7
        latent.capture(child_slots, pool_rows)
        before = [part.clone() for part in cache]
        latent.load(RemapRows(pool_rows, real_slots, d), None)

        fresh = _mla_cache(torch.float32)
        impl.exec_kv_prefill(
            kv_no_split, *_ascend_cos_sin(rope, p + d), fresh, real_slots
        )
        blocks, offsets = real_slots // MLA_BLOCK, real_slots % MLA_BLOCK
        assert torch.equal(cache[0][blocks, offsets], fresh[0][blocks, offsets]), (
            adaptor
        )
        got, want = cache[1][blocks, offsets], fresh[1][blocks, offsets]
        # fp32 cos/sin of the cache at positions up to 3000 (as the standard check)
        assert torch.allclose(got, want, atol=2e-4), (adaptor, (got - want).abs().max())
        # k_pe not moved would be far off: the check can fail.
        unmoved = cache[1][child_slots // MLA_BLOCK, child_slots % MLA_BLOCK]
        assert (unmoved - want).abs().max() > 0.1
        written = torch.zeros(MLA_BLOCKS, MLA_BLOCK, dtype=torch.bool)
        written[blocks, offsets] = True
        for part, old in zip(cache, before):
            assert torch.equal(part[~written], old[~written]), (
                "rows written outside their slots"
            )


def check_mla_reader_returns_what_the_writer_wrote() -> None:
    """bf16 rows through the registered writer and back through its reader: the same
    bytes; on the cache, kv_c in the latent cache and k_pe de-interleaved (evens,
    then odds) in the rope cache, at block slot // 128, offset slot % 128."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        latent_writer_for,
    )
    from vllm_ascend.distributed.chunk_cache_npu import register_npu_chunk_cache

    device_op = _device_op()
    _ascend_config()
    register_npu_chunk_cache()
    impl = _mla_impl(torch.ones(RANK))
    layer = types.SimpleNamespace(impl=impl)
    writer = latent_writer_for(impl)
    gen = torch.Generator().manual_seed(1)
    n = 300  # more than two NPU blocks
    kv_c = torch.randn(n, RANK, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(n, ROPE, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(MLA_BLOCKS * MLA_BLOCK, generator=gen)[:n]
    for adaptor in (device_op.BaseDeviceAdaptor, device_op.A5DeviceAdaptor):
        device_op.DeviceOperator = adaptor
        cache = _mla_cache(torch.bfloat16)
        writer.write(layer, kv_c, k_pe, slots, cache)
        rows = writer.read(cache, slots)
        assert rows.dtype == torch.bfloat16 and rows.shape == (n, RANK + ROPE)
        assert torch.equal(
            rows.view(torch.int16), torch.cat((kv_c, k_pe), -1).view(torch.int16)
        ), adaptor
        s = int(slots[5])
        assert torch.equal(cache[0][s // MLA_BLOCK, s % MLA_BLOCK, 0], kv_c[5])
        assert torch.equal(
            cache[1][s // MLA_BLOCK, s % MLA_BLOCK, 0, : ROPE // 2], k_pe[5, 0::2]
        )
        assert torch.equal(
            cache[1][s // MLA_BLOCK, s % MLA_BLOCK, 0, ROPE // 2 :], k_pe[5, 1::2]
        )


def check_mla_refusals() -> None:
    """What the Ascend MLA writer cannot write is refused when LatentLayer.of reads
    zero rows at start-up; SFA/DSA models are refused when the config is built,
    naming the indexer's cache."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import support
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        latent_writer_for,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.mla_latent_layers import (  # noqa: E501
        LatentLayer,
    )
    from vllm_ascend.distributed.chunk_cache_npu import register_npu_chunk_cache

    _device_op()
    register_npu_chunk_cache()
    impl = _mla_impl(torch.ones(RANK))
    layer = types.SimpleNamespace(impl=impl, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    writer = latent_writer_for(impl)
    rotation = _deepseek_rotation()

    def refused(cache, words, rot=rotation, **flags):
        _ascend_config(**flags)
        try:
            LatentLayer.of("l0", layer, cache, rot, writer, 8, torch.bfloat16)
        except ValueError as e:
            assert words in str(e), str(e)
            return
        raise AssertionError(f"not refused: {words}")

    bf16 = _mla_cache(torch.bfloat16)
    refused(bf16, "enable_kv_nz", enable_kv_nz=True)
    int8 = tuple(part.to(torch.int8) for part in bf16)  # fa_quant's latent cache
    refused(int8, "quantized")
    indexer = torch.zeros(MLA_BLOCKS, MLA_BLOCK, 1, 128, dtype=torch.bfloat16)
    refused((*bf16, indexer), "indexer")  # SFA's (latent, rope, indexer key)
    refused(bf16, "rope of MLA layer", rot=None)  # k_pe would stay where it was
    _ascend_config()
    assert LatentLayer.of(
        "l0", layer, bf16, rotation, writer, 8, torch.bfloat16
    ).pool.shape == (8, RANK + ROPE)

    model = types.SimpleNamespace(
        use_mla=True, hf_config=types.SimpleNamespace(index_topk=2048)
    )
    try:
        support._check_model_kind(model)
    except ValueError as e:
        assert "indexer" in str(e) and "SFA" in str(e), str(e)
    else:
        raise AssertionError("SFA/DSA not refused")


INDEX_DIM, INDEX_HEADS, HIDDEN = 128, 4, 96  # V3.2's indexer key width


def _sfa_impl(gamma: torch.Tensor, hidden: int = HIDDEN):
    """An AscendSFAImpl with what its cache writes and indexer_select_pre_process read
    (its __init__ needs an NPU model config): the plain configuration (no C8, no DSA
    context parallelism, neox indexer rope as for deepseek_v32)."""
    from vllm_ascend.attention.sfa_v1 import AscendSFAImpl

    gen = torch.Generator().manual_seed(3)
    impl = AscendSFAImpl.__new__(AscendSFAImpl)
    impl.num_kv_heads, impl.kv_lora_rank, impl.qk_rope_head_dim = 1, RANK, ROPE
    impl.kv_a_layernorm = types.SimpleNamespace(weight=gamma, variance_epsilon=1e-6)
    impl.enable_sparse_sfa_c8 = impl.enable_sparse_li_c8 = impl.enable_dsa_cp = False
    impl.enable_mlapo = impl.enable_sfa_prolog_v3 = impl.enable_kv_nz = False
    impl.use_torch_npu_lightning_indexer = False
    impl.has_indexer, impl.is_rope_neox_style, impl.layer_name = True, True, "l0"
    impl.head_dim, impl.n_head = INDEX_DIM, INDEX_HEADS
    weight = torch.randn(INDEX_DIM + INDEX_HEADS, hidden, generator=gen) / hidden**0.5
    impl.wk_weights_proj = lambda x: (
        x @ weight.T,
        None,
    )  # MergedColumnParallelLinear's
    norm = torch.nn.LayerNorm(INDEX_DIM, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2, generator=gen)
        norm.bias.normal_(0.0, 0.2, generator=gen)
    impl.k_norm = norm
    return impl


def _sfa_cache(dtype, indexer: bool = True):
    parts = _mla_cache(dtype)
    if indexer:
        parts += (torch.zeros(MLA_BLOCKS, MLA_BLOCK, 1, INDEX_DIM, dtype=dtype),)
    return parts


def _sfa_forward_writes(impl, kv_no_split, x, cos, sin, cache, slots) -> None:
    """What AscendSFAImpl.forward writes for these tokens on its native prefill path:
    `exec_kv` (npu_kv_rmsnorm_rope_cache into parts 0 and 1), then the indexer key of
    `indexer_select_pre_process` through the forward's own `npu_scatter_nd_update_` on
    part 2 (sfa_v1.py; the forward itself needs NPU metadata, so its two write lines
    are repeated here, the rest is vllm-ascend's code)."""
    import torch_npu

    impl.exec_kv(kv_no_split, cos, sin, cache, slots, None)
    with torch.no_grad():
        k_li, k_li_scale = impl.indexer_select_pre_process(x=x, cos=cos, sin=sin)
    assert k_li_scale is None
    torch_npu.npu_scatter_nd_update_(
        cache[2].view(-1, k_li.shape[-1]),
        slots.view(-1, 1),
        k_li.view(-1, k_li.shape[-1]),
    )


def check_sfa_load_writes_what_ascend_writes_at_the_new_position(rope=None) -> None:
    """A child's rows written by AscendSFAImpl's own code at positions p (the latent
    through exec_kv, the indexer key from indexer_select_pre_process: k_norm(wk x),
    rope on its first 64 values with MLA's cos/sin, neox), captured through the
    registered readers into one pool row [kv_c | k_pe | index_k], loaded at p + d
    through LatentLayer (kv_c copied, k_pe and the key's rope slice rotated by d) and
    the registered writers: the three caches then hold what AscendSFAImpl's own writes
    of the same tokens at p + d hold. With vLLM's rope, then vllm-ascend's own
    (AscendDeepseekScalingRotaryEmbedding, whose rotation pairs halves)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        latent_writer_for,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.mla_latent_layers import (  # noqa: E501
        INDEXER_SCRATCH,
        LatentLayer,
    )
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.position_remapper import RemapRows, RemapScratch, RopeRotation
    from vllm_ascend.distributed.chunk_cache_npu import register_npu_chunk_cache

    device_op = _device_op()
    _ascend_config()
    register_npu_chunk_cache()
    with set_current_vllm_config(VllmConfig()):
        ropes = [
            get_rope(
                ROPE,
                max_position=4096,
                rope_parameters=dict(DEEPSEEK_YARN),
                is_neox_style=False,
                dtype=torch.float32,
            )
        ]
    ropes.append(_ascend_ropes()["deepseek_yarn"][0])
    gen = torch.Generator().manual_seed(0)
    n = 20
    gamma = torch.rand(RANK, generator=gen) + 0.5
    impl = _sfa_impl(gamma)
    layer = types.SimpleNamespace(
        impl=impl,
        kv_lora_rank=RANK,
        qk_rope_head_dim=ROPE,
        use_sparse=True,
        layer_name="l0",
    )
    kv_no_split = torch.randn(n, RANK + ROPE, generator=gen)
    x = torch.randn(n, HIDDEN, generator=gen)
    p = torch.randint(0, 1500, (n,), generator=gen)
    d = torch.randint(-1500, 1500, (n,), generator=gen).clamp(min=-p)
    child_slots = torch.randperm(MLA_BLOCKS * MLA_BLOCK, generator=gen)[:n]
    real_slots = torch.tensor(
        [2 * MLA_BLOCK + 100 + i for i in range(n)]
    )  # crosses a block
    blocks, offsets = real_slots // MLA_BLOCK, real_slots % MLA_BLOCK

    for rope in ropes:
        rotation = RopeRotation(rope)
        for adaptor in (device_op.BaseDeviceAdaptor, device_op.A5DeviceAdaptor):
            device_op.DeviceOperator = adaptor  # A2/A3, then A5 (the latent write)
            cache = _sfa_cache(torch.float32)
            _sfa_forward_writes(
                impl, kv_no_split, x, *_ascend_cos_sin(rope, p), cache, child_slots
            )
            scratch = RemapScratch(max_rows=32)
            latent = LatentLayer.of(
                "l0",
                layer,
                cache,
                rotation,
                latent_writer_for(impl),
                num_rows=64,
                dtype=torch.float32,
                scratch=scratch,
            )
            assert latent.indexer is not None and latent.pool.shape == (
                64,
                RANK + ROPE + 128,
            )
            assert latent.indexer.rotation.is_neox_style  # the key's pairing: halves
            roles, shapes = latent.scratch_plan()
            assert roles[-len(INDEXER_SCRATCH) :] == INDEXER_SCRATCH and shapes[
                "i"
            ] == (128,)
            pool_rows = torch.arange(n) + 7
            latent.capture(child_slots, pool_rows)
            before = [part.clone() for part in cache]
            latent.load(RemapRows(pool_rows, real_slots, d), None)

            fresh = _sfa_cache(torch.float32)
            _sfa_forward_writes(
                impl, kv_no_split, x, *_ascend_cos_sin(rope, p + d), fresh, real_slots
            )
            assert torch.equal(cache[0][blocks, offsets], fresh[0][blocks, offsets])
            for part, what in ((1, "k_pe"), (2, "indexer key")):
                got, want = cache[part][blocks, offsets], fresh[part][blocks, offsets]
                assert torch.allclose(got, want, atol=2e-4), (
                    what,
                    (got - want).abs().max(),
                )
                # Not moved would be far off: the check can fail.
                unmoved = cache[part][child_slots // MLA_BLOCK, child_slots % MLA_BLOCK]
                assert (unmoved - want).abs().max() > 0.1, what
            # The key's values past the rope slice carry no position: bit for bit.
            assert torch.equal(
                cache[2][blocks, offsets, 0, ROPE:], fresh[2][blocks, offsets, 0, ROPE:]
            )
            written = torch.zeros(MLA_BLOCKS, MLA_BLOCK, dtype=torch.bool)
            written[blocks, offsets] = True
            for part, old in zip(cache, before):
                assert torch.equal(part[~written], old[~written]), (
                    "rows written outside"
                )


def check_sfa_reader_returns_what_the_writer_wrote() -> None:
    """bf16 rows through the registered SFA writers and back: the same bytes; the
    indexer key as is in part 2 at block slot // 128, offset slot % 128; a layer whose
    cache has no indexer part (skip_topk) keeps latent rows only."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        latent_writer_for,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.indexer_keys_layers import (  # noqa: E501
        indexer_writer_for,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.mla_latent_layers import (  # noqa: E501
        LatentLayer,
    )
    from vllm_ascend.distributed.chunk_cache_npu import register_npu_chunk_cache

    device_op = _device_op()
    _ascend_config()
    register_npu_chunk_cache()
    impl = _sfa_impl(torch.ones(RANK))
    layer = types.SimpleNamespace(impl=impl, layer_name="l0")
    latent_writer, index_writer = latent_writer_for(impl), indexer_writer_for(impl)
    assert latent_writer.backend == index_writer.backend == "ASCEND_SFA"
    gen = torch.Generator().manual_seed(1)
    n = 300  # more than two NPU blocks
    kv_c = torch.randn(n, RANK, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(n, ROPE, generator=gen).to(torch.bfloat16)
    keys = torch.randn(n, INDEX_DIM, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(MLA_BLOCKS * MLA_BLOCK, generator=gen)[:n]
    for adaptor in (device_op.BaseDeviceAdaptor, device_op.A5DeviceAdaptor):
        device_op.DeviceOperator = adaptor
        cache = _sfa_cache(torch.bfloat16)
        latent_writer.write(layer, kv_c, k_pe, slots, cache)
        index_writer.write(layer, keys, slots, cache)
        rows = latent_writer.read(cache, slots)
        assert torch.equal(
            rows.view(torch.int16), torch.cat((kv_c, k_pe), -1).view(torch.int16)
        )
        assert torch.equal(
            index_writer.read(layer, cache, slots).view(torch.int16),
            keys.view(torch.int16),
        )
        s = int(slots[5])
        assert torch.equal(cache[2][s // MLA_BLOCK, s % MLA_BLOCK, 0], keys[5])
    dense = types.SimpleNamespace(
        impl=impl,
        kv_lora_rank=RANK,
        qk_rope_head_dim=ROPE,
        use_sparse=True,
        layer_name="l1",
    )
    two = LatentLayer.of(
        "l1",
        dense,
        _sfa_cache(torch.bfloat16, indexer=False),
        _deepseek_rotation(),
        latent_writer,
        8,
        torch.bfloat16,
    )
    assert two.indexer is None and two.pool.shape == (8, RANK + ROPE)


def check_sfa_li_c8_load_quantizes_as_ascend_at_the_new_position() -> None:
    """enable_sparse_li_c8 (A2/A3: int8 key, fp16 per-token scale; refused at start-up,
    its built path run here with ACCEPT_QUANTIZED_INDEXER on): the cache holds
    the Hadamard-transformed, quantized key, so the capture takes the key before
    quantization from patch 0003's seam (turned on by the registered writer's layer
    check at start-up), and the load quantizes the moved key through the layer's own
    `quantize_indexer_key`. In bf16 as the model runs: the moved key equals
    vllm-ascend's key at p + d within one bf16 ulp (bit for bit past the rope slice),
    what the load wrote is vllm-ascend's own quantization of it bit for bit (key and
    scale), and so the fresh write up to that rounding carried through the transform."""
    import numpy as np
    import scipy.linalg
    import torch_npu
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        latent_writer_for,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.mla_latent_layers import (  # noqa: E501
        LatentLayer,
    )
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.indexer_keys import reposition_indexer_keys
    from vllm.v1.worker.position_remapper import RemapRows, RopeRotation

    _device_op()  # first: vllm_ascend.ops before the attention modules
    from vllm_ascend.attention.sfa_v1 import AscendSFAImpl
    from vllm_ascend.distributed import chunk_cache_npu
    from vllm_ascend.distributed.chunk_cache_npu import register_npu_chunk_cache

    # Refused by default (not translation-invariant: docs/design/sparse.md); the built
    # path is run here with the refusal turned off.
    chunk_cache_npu.ACCEPT_QUANTIZED_INDEXER = True
    _ascend_config()
    register_npu_chunk_cache()
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            ROPE,
            max_position=4096,
            rope_parameters=dict(DEEPSEEK_YARN),
            is_neox_style=False,
            dtype=torch.float32,
        )
    AscendSFAImpl.k_hadamard = torch.tensor(
        np.asarray(scipy.linalg.hadamard(128)), dtype=torch.bfloat16
    ) / (128**0.5)
    gen = torch.Generator().manual_seed(4)
    n = 40
    impl = _sfa_impl((torch.rand(RANK, generator=gen) + 0.5).to(torch.bfloat16))
    impl.k_norm = impl.k_norm.to(torch.bfloat16)
    weight = torch.randn(INDEX_DIM + INDEX_HEADS, HIDDEN, generator=gen).to(
        torch.bfloat16
    )
    impl.wk_weights_proj = lambda x: (x @ weight.T / HIDDEN**0.5, None)
    impl.enable_sparse_li_c8 = True
    impl.c8_k_cache_dtype, impl.c8_k_scale_cache_dtype = torch.int8, torch.float16
    assert not impl.chunk_cache_capture  # patch 0003's default: the seam stores nothing
    layer = types.SimpleNamespace(
        impl=impl,
        kv_lora_rank=RANK,
        qk_rope_head_dim=ROPE,
        use_sparse=True,
        layer_name="l0",
    )

    def cache():
        return (
            *_mla_cache(torch.bfloat16),
            torch.zeros(MLA_BLOCKS, MLA_BLOCK, 1, INDEX_DIM, dtype=torch.int8),
            torch.zeros(MLA_BLOCKS, MLA_BLOCK, 1, 1, dtype=torch.float16),
        )

    def forward_writes(positions, kv_cache, slots):
        # AscendSFAImpl.forward on its native path, li_c8: exec_kv, the pre-process
        # (which quantizes), the patched slots record, the two scatters.
        cos, sin = (t.to(torch.bfloat16) for t in _ascend_cos_sin(rope, positions))
        impl.exec_kv(kv_no_split, cos, sin, kv_cache, slots, None)
        with torch.no_grad():
            k_li, k_li_scale = impl.indexer_select_pre_process(x=x, cos=cos, sin=sin)
        assert k_li.dtype == torch.int8 and k_li_scale.dtype == torch.float16
        if impl.chunk_cache_capture:
            impl.chunk_cache_k_li_slots = slots
        torch_npu.npu_scatter_nd_update_(
            kv_cache[2].view(-1, 128), slots.view(-1, 1), k_li.view(-1, 128)
        )
        torch_npu.npu_scatter_nd_update_(
            kv_cache[3].view(-1, 1), slots.view(-1, 1), k_li_scale.view(-1, 1)
        )

    kv_no_split = torch.randn(n, RANK + ROPE, generator=gen).to(torch.bfloat16)
    x = torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16)
    p = torch.randint(0, 1500, (n,), generator=gen)
    d = torch.randint(-1500, 1500, (n,), generator=gen).clamp(min=-p)
    child_slots = torch.randperm(MLA_BLOCKS * MLA_BLOCK, generator=gen)[:n]
    real_slots = torch.tensor([2 * MLA_BLOCK + 90 + i for i in range(n)])
    blocks, offsets = real_slots // MLA_BLOCK, real_slots % MLA_BLOCK

    child = cache()
    latent = LatentLayer.of(
        "l0",
        layer,
        child,
        RopeRotation(rope),
        latent_writer_for(impl),
        num_rows=64,
        dtype=torch.bfloat16,
    )
    assert impl.chunk_cache_capture and latent.pool.shape == (
        64,
        RANK + ROPE + INDEX_DIM,
    )
    forward_writes(p, child, child_slots)
    pool_rows = torch.arange(n) + 3
    latent.capture(child_slots, pool_rows)
    # The pool holds the key before quantization: what the pre-process computed.
    assert torch.equal(
        latent.pool[pool_rows, RANK + ROPE :], impl.chunk_cache_k_li.view(n, -1)
    )
    latent.load(RemapRows(pool_rows, real_slots, d), None)

    stored = latent.pool[pool_rows, RANK + ROPE :].clone()
    fresh = cache()
    forward_writes(p + d, fresh, real_slots)
    fresh_key = impl.chunk_cache_k_li.view(n, -1)  # vllm-ascend's key at p + d, pre-C8
    assert torch.equal(child[0][blocks, offsets], fresh[0][blocks, offsets])
    # 1. The moved key is the fresh key up to bf16 rounding: vllm-ascend ropes with
    # bf16 cos/sin (2^-9 relative each) at p and at p + d, the load rotates in fp32.
    moved = reposition_indexer_keys(
        latent.indexer.layout, latent.indexer.rotation, stored.float(), d
    ).to(torch.bfloat16)
    err = (moved.float() - fresh_key.float()).abs().amax(-1)
    scale = fresh_key.float().abs().amax(-1)
    assert (err <= scale * 2.0**-6).all(), (err / scale).max()
    assert torch.equal(moved[:, ROPE:], fresh_key[:, ROPE:])  # no position: bit for bit
    # 2. What the load wrote is vllm-ascend's own C8 quantization of that key, exactly.
    with torch.no_grad():
        want_q, want_scale = impl.quantize_indexer_key(moved)
    assert torch.equal(child[2][blocks, offsets, 0], want_q.view(n, -1))
    assert torch.equal(child[3][blocks, offsets, 0], want_scale.view(n, -1))
    # 3. Against the fresh write: the same up to that rounding carried through the
    # Hadamard transform and the int8 step (observed: at most 2 steps, 13% of values).
    steps = (child[2][blocks, offsets].int() - fresh[2][blocks, offsets].int()).abs()
    assert steps.max() <= 2, steps.max()
    print(
        f"li_c8: moved vs fresh key {float((err / scale).max()):.2e} of the row's max; "
        f"int8 steps vs the fresh write: max {int(steps.max())}, "
        f"{float((steps > 0).float().mean()):.1%} of values"
    )
    unmoved = child[2][child_slots // MLA_BLOCK, child_slots % MLA_BLOCK].int()
    assert (
        unmoved - fresh[2][blocks, offsets].int()
    ).abs().max() > 10  # not moved: far


def check_sfa_refusals() -> None:
    """What the SFA writers cannot write is refused when LatentLayer.of builds the layer
    at start-up, naming it: each C8 cache, DSA-CP, the fused decode writes, the NZ
    cache, store_kv_block, glm_moe_dsa's interleaved indexer rope; and vllm-ascend's
    DSA (AscendDSAImpl) has no writer at all."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        latent_writer_for,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.mla_latent_layers import (  # noqa: E501
        LatentLayer,
    )
    from vllm_ascend.distributed.chunk_cache_npu import register_npu_chunk_cache

    _device_op()
    register_npu_chunk_cache()
    rotation = _deepseek_rotation()
    bf16 = _sfa_cache(torch.bfloat16)

    def refused(words, cache=bf16, config=None, **flags):
        _ascend_config(**(config or {}))
        impl = _sfa_impl(torch.ones(RANK))
        for flag, value in flags.items():
            setattr(impl, flag, value)
        layer = types.SimpleNamespace(
            impl=impl,
            kv_lora_rank=RANK,
            qk_rope_head_dim=ROPE,
            use_sparse=True,
            layer_name="l0",
        )
        try:
            LatentLayer.of(
                "l0", layer, cache, rotation, latent_writer_for(impl), 8, torch.bfloat16
            )
        except ValueError as e:
            assert words in str(e), str(e)
            return
        raise AssertionError(f"not refused: {words}")

    li_c8 = (
        *bf16[:2],
        bf16[2].to(torch.int8),
        torch.zeros(MLA_BLOCKS, MLA_BLOCK, 1, 1, dtype=torch.float16),
    )
    refused("not translation-invariant", cache=li_c8, enable_sparse_li_c8=True)
    refused("enable_sparse_sfa_c8", enable_sparse_sfa_c8=True)
    refused(
        "the latent's dtype", cache=(*bf16[:2], bf16[2].to(torch.int8))
    )  # no scale part
    refused("enable_dsa_cp", enable_dsa_cp=True)
    refused("MLAPO", enable_mlapo=True)
    refused("prolog v3", enable_sfa_prolog_v3=True)
    refused("enable_kv_nz", enable_kv_nz=True)
    refused("interleaved indexer rope", is_rope_neox_style=False)
    refused("c8_enable_reshape_optim", config={"c8_enable_reshape_optim": True})
    _ascend_config()

    from vllm_ascend.attention.dsa_v1 import AscendDSAImpl

    dsa = types.SimpleNamespace(
        impl=AscendDSAImpl.__new__(AscendDSAImpl),
        kv_lora_rank=RANK,
        qk_rope_head_dim=ROPE,
        use_sparse=True,
    )
    assert (
        latent_writer_for(dsa.impl) is None
    )  # refused by support.check_attention_layer
    try:
        LatentLayer.of(
            "l0",
            dsa,
            bf16,
            rotation,
            latent_writer_for(_sfa_impl(torch.ones(RANK))),
            8,
            torch.bfloat16,
        )
    except ValueError as e:
        assert "AscendDSAImpl" in str(e) and "indexer" in str(e), str(e)
    else:
        raise AssertionError("AscendDSAImpl's indexer accepted")


if __name__ == "__main__":
    from check_batch import main

    # What every check imports, whichever it imports first.
    main(
        globals(),
        preamble=lambda: None,
        preload=(
            "vllm.config",
            "vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache",
            "vllm.v1.worker.position_remapper",
        ),
    )
