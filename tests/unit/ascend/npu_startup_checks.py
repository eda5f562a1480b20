"""Start-up checks of the chunk cache against vllm-ascend's real code (issue 29,
findings 5, 6, 7 and 9), run in a subprocess by test_ascend_stubbed.py with the stub
`torch_npu` and the patched vllm-ascend tree on PYTHONPATH, like npu_stub_checks.py.

Each check makes vllm-ascend's own code say what it would do (its config readers,
its quantization config, its model runner's KV allocation, its MLA weight
processing) and holds the chunk cache's start-up to it. The platform is vLLM's CPU
platform (VLLM_PLUGINS=none) until a check installs vllm-ascend's real
`NPUPlatform` as vLLM's current platform, which is all the checks under test read
of it. Nothing here runs an NPU op.

    python npu_startup_checks.py CHECK_NAME
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import torch

_build_info = types.ModuleType("vllm_ascend._build_info")
_build_info.__device_type__ = "A2"
sys.modules["vllm_ascend._build_info"] = _build_info

MODELS = Path(
    os.environ.get(
        "FORK_MODELS", Path(__file__).resolve().parents[3] / ".cache" / "models"
    )
)


def _on_npu() -> None:
    """vllm-ascend's NPUPlatform as vLLM's current platform (what `vllm.platforms`
    resolves on an Ascend machine)."""
    import vllm.platforms
    import vllm_ascend
    import vllm_ascend.ops  # noqa: F401 - the import order vllm-ascend itself uses
    from vllm_ascend.platform import NPUPlatform

    vllm_ascend._build_info = _build_info
    vllm.platforms.current_platform = NPUPlatform()
    assert vllm.platforms.current_platform.device_type == "npu"


def _refused(config, words: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
        check_config,
    )

    try:
        check_config(config)
    except ValueError as e:
        assert words in str(e), str(e)
        return
    raise AssertionError(f"not refused on the NPU platform: {words}")


def _chunk_cache_config(**kwargs):
    """A VllmConfig with the chunk cache on (its connector set by vLLM's own
    __post_init__, on the CPU platform), no model."""
    from vllm.config import ChunkCacheConfig, VllmConfig

    return VllmConfig(
        chunk_cache_config=ChunkCacheConfig(
            enable_chunk_cache=True, chunk_context="none"
        ),
        **kwargs,
    )


def check_hamming_sparse_refused() -> None:
    """Finding 5: both spellings vllm-ascend reads (the attention layer's
    `is_enable_hamming_sparse`: additional_config enable_hamming_sparse; the
    runner's AscendConfig: hamming_sparse.enabled) turn kvcomp on there, and each
    is refused at start-up; without them the config passes."""
    import tempfile

    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
        check_config,
    )
    from vllm_ascend.ascend_config import AscendConfig
    from vllm_ascend.attention.kvcomp_attn.attention_utils import (
        is_enable_hamming_sparse,
    )

    with tempfile.NamedTemporaryFile("w", suffix=".json") as sparse_json:
        by_layer = _chunk_cache_config(
            additional_config={"enable_hamming_sparse": True}
        )
        by_runner = _chunk_cache_config(
            additional_config={
                "hamming_sparse": {
                    "enabled": True,
                    "sparse_json_location": sparse_json.name,
                }
            }
        )
        with set_current_vllm_config(by_layer):
            assert is_enable_hamming_sparse()  # AscendAttentionBackendImpl's reader
        assert AscendConfig(by_runner).enable_hamming_sparse  # NPUModelRunner's
        without = _chunk_cache_config(
            additional_config={"hamming_sparse": {"enabled": False}}
        )
        _on_npu()
        _refused(by_layer, "hamming sparse")
        _refused(by_runner, "hamming sparse")
    check_config(without)


def check_pp_refused_on_npu() -> None:
    """Finding 6: the connector's role (kv_both) is a producer for vllm-ascend, and
    its runner then skips the PP broadcast of sampled tokens: PP > 1 is refused on
    the NPU platform (and still accepted by this check on CPU)."""
    import inspect

    from vllm.config import ParallelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
        check_config,
    )
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    pp2 = _chunk_cache_config(parallel_config=ParallelConfig(pipeline_parallel_size=2))
    assert pp2.kv_transfer_config.kv_role == "kv_both"
    assert pp2.kv_transfer_config.is_kv_producer
    # What the refusal is for, in vllm-ascend's runner (a tripwire if it changes).
    source = inspect.getsource(NPUModelRunner.sample_tokens)
    assert "skip_pp_pd_broadcast = self.is_kv_producer and pp.world_size > 1" in source
    check_config(pp2)  # vLLM's CPU platform: vLLM's own runner
    pp1 = _chunk_cache_config()
    _on_npu()
    _refused(pp2, "pipeline parallelism on Ascend NPUs (--pipeline-parallel-size 2)")
    check_config(pp1)


def check_fa_quant_and_pd_mix_refused() -> None:
    """Finding 6: a checkpoint with fa_quant makes vllm-ascend's runner allocate an
    int8 latent cache as a KV consumer (its own `enable_fa_quant` says so for our
    kv_both config), and a W8A8_MIX one switches its linear layers to the decode
    node's static quantization (its own scheme says so): both refused on the NPU."""
    from vllm.config import set_current_vllm_config
    from vllm_ascend.quantization.methods.w8a8_pdmix import AscendW8A8PDMixLinearMethod
    from vllm_ascend.quantization.modelslim_config import AscendModelSlimConfig
    from vllm_ascend.quantization.utils import enable_fa_quant

    config = _chunk_cache_config()
    config.quant_config = AscendModelSlimConfig(
        {"fa_quant_type": "FAQuant", "model.layers.0.self_attn.fa_k.scale": "FLOAT"}
    )
    assert enable_fa_quant(config)  # the runner's allocation: int8 on A2/A3
    _on_npu()
    _refused(config, "fa_quant")

    config.quant_config = AscendModelSlimConfig(
        {"model.layers.0.mlp.down_proj.weight": "W8A8_MIX"}
    )
    with set_current_vllm_config(config):
        assert AscendW8A8PDMixLinearMethod()._is_kv_consumer  # static quantization
    _refused(config, "W8A8_MIX")
    config.quant_config = AscendModelSlimConfig(
        {"model.layers.0.mlp.down_proj.weight": "W8A8"}
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
        check_config,
    )

    check_config(config)


def _carve_and_allocate(model_name: str, spec_of, late_model: bool = False) -> None:
    """A budget B carved by the chunk cache for `model_name`, sized into a paged cache
    by vLLM's own `get_kv_cache_configs` (`spec_of(model, parallel)` per layer) and
    allocated by vllm-ascend's real `_allocate_kv_cache_tensors` (CPU tensors): what
    that allocates (2 MiB of alignment per cache tensor included), plus the pool and its
    load buffers, stays within B."""
    from vllm.config import ChunkCacheConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        POOL_BLOCK_SIZE,
        carve_chunk_pool,
        load_scratch_bytes,
        pool_bytes_per_token,
        pool_num_blocks,
    )
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    model = ModelConfig(
        model=str(MODELS / model_name), dtype="float32", max_model_len=512
    )
    chunk_cache = ChunkCacheConfig(
        enable_chunk_cache=True, max_chunk_load_tokens=256, chunk_context="none"
    )
    if late_model:
        # NOTE: vLLM's CPU platform refuses sparse MLA when the config is checked
        # (support._check_model_kind); the NPU platform's config is not built here.
        config = VllmConfig(chunk_cache_config=chunk_cache)
        config.model_config = model
    else:
        config = VllmConfig(model_config=model, chunk_cache_config=chunk_cache)
    config.cache_config.block_size = 128  # the NPU block size
    _on_npu()
    budget = 64 << 20
    left = carve_chunk_pool(config, budget)
    layers = model.get_num_layers(config.parallel_config)
    spec = spec_of(model, config.parallel_config)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    kv_cache_config = get_kv_cache_configs(config, [{n: spec for n in names}], [left])[
        0
    ]

    runner = NPUModelRunner.__new__(NPUModelRunner)
    runner.vllm_config, runner.device = config, torch.device("cpu")
    runner.use_sparse = getattr(spec, "sparse_head_dim", None) is not None
    runner.use_compress = False
    runner.runner_only_attn_layers = set()
    raw = runner._allocate_kv_cache_tensors(kv_cache_config)
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for parts in raw.values()
        for t in parts
    }
    parts = len(next(iter(raw.values())))
    allocated = sum(storages.values())
    paged = sum(t.size for t in kv_cache_config.kv_cache_tensors)
    assert len(storages) == parts * layers, (len(storages), parts, layers)
    assert allocated >= paged + parts * layers * (2 << 20), (
        allocated,
        paged,
    )  # the padding
    pool = (
        pool_num_blocks(config, kv_cache_config)
        * POOL_BLOCK_SIZE
        * pool_bytes_per_token(config)
    )
    total = allocated + pool + load_scratch_bytes(config)
    assert total <= budget, f"{total} bytes allocated for a budget of {budget}"
    print(
        model_name,
        "cache tensors per layer:",
        parts,
        "allocated + pool + buffers:",
        total,
    )


def check_carve_counts_the_npu_kv_alignment() -> None:
    """Finding 6: with a KV connector, vllm-ascend's runner allocates every K and V
    tensor 2 MiB larger (to align it); the carve counts it (`_carve_and_allocate`)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    _carve_and_allocate(
        "tiny-llama",
        lambda model, parallel: FullAttentionSpec(
            block_size=128,
            num_kv_heads=model.get_num_kv_heads(parallel),
            head_size=model.get_head_size(),
            dtype=torch.float32,
        ),
    )


def check_carve_counts_the_npu_kv_alignment_for_sfa() -> None:
    """Finding 6, SFA (DeepSeek-V3.2, registered on the NPU: issue 32): vllm-ascend's
    runner allocates three aligned tensors per layer (latent, rope, indexer key), from
    the spec its own `get_kv_cache_spec` builds (`AscendMLAAttentionSpec` with
    `sparse_head_dim`). Before: the carve counted two per layer, and the third's 2 MiB
    per layer went past the budget."""
    from vllm_ascend.core.kv_cache_interface import AscendMLAAttentionSpec

    def sfa_spec(model, parallel):
        text = model.hf_text_config
        dims = (text.kv_lora_rank, text.qk_rope_head_dim, text.index_head_dim)
        return AscendMLAAttentionSpec(
            block_size=128,
            num_kv_heads=1,
            head_size=sum(dims),
            sparse_head_dim=dims,
            dtype=torch.float32,
        )

    _carve_and_allocate("tiny-deepseek-v32", sfa_spec, late_model=True)


def check_capture_check_avoids_assert_async_on_npu() -> None:
    """Finding 7: the capture's batch check runs without `torch._assert_async` on
    the NPU platform (the op has no NPU kernel: here it raises as the missing
    kernel would), and still refuses a slot missing from the batch."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
        ChildStore,
        ChunkCacheMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        POOL_BLOCK_SIZE,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.worker import (
        ChunkCacheWorker,
    )

    def no_npu_kernel(*args, **kwargs):
        raise NotImplementedError(
            "Could not run 'aten::_assert_async.msg' with arguments "
            "from the 'PrivateUse1' backend (stand-in)"
        )

    _on_npu()
    torch._assert_async = no_npu_kernel
    store = ChildStore(
        block_ids=(2, 0),
        pool_block_ids=(10,),
        first_position=1,
        end_position=5,
        store_start=1,
    )
    worker = types.SimpleNamespace(block_size=4)
    slot_mapping = torch.tensor([7, 9, 10, 11, 0, 13], dtype=torch.int32)
    rows, dst = ChunkCacheWorker._capture_indices(
        worker, ChunkCacheMetadata(stores=[store]), slot_mapping
    )
    assert rows.tolist() == [1, 2, 3, 4]
    assert dst.tolist() == [10 * POOL_BLOCK_SIZE + i for i in range(4)]
    missing = ChildStore(
        block_ids=(1,),
        pool_block_ids=(0,),
        first_position=0,
        end_position=1,
        store_start=0,
    )
    try:
        ChunkCacheWorker._capture_indices(
            worker, ChunkCacheMetadata(stores=[missing]), slot_mapping
        )
    except RuntimeError as e:
        assert "not in this step's batch" in str(e), str(e)
    else:
        raise AssertionError("a slot missing from the batch was not refused")


def check_mlapo_is_read_per_layer_after_weights_load() -> None:
    """Finding 9: on A5 vllm-ascend's MLAPO flag is on by default (its own
    `enabling_mlapo`), and its `process_weights_after_loading` turns it off for a
    layer whose fused_qkv_a_proj is not W8A8 (a bf16 checkpoint): that layer is
    accepted (the latent pool is built); a layer left with MLAPO is refused by
    the start-up layer check, naming it."""
    import vllm_ascend.ascend_config as ascend_config
    import vllm_ascend.utils as ascend_utils
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import support
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        latent_writer_for,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.mla_latent_layers import (  # noqa: E501
        LatentLayer,
    )
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.position_remapper import RopeRotation
    from vllm_ascend.attention import mla_v1
    from vllm_ascend.attention.utils import enabling_mlapo
    from vllm_ascend.distributed.chunk_cache_npu import register_npu_chunk_cache

    # vLLM's GPT-J rope (built before the NPU platform would pick Ascend's class).
    plain = VllmConfig()  # no KV connector role of its own
    with set_current_vllm_config(plain):
        rope = get_rope(
            64,
            max_position=4096,
            is_neox_style=False,
            rope_parameters={"rope_type": "default"},
            dtype=torch.float32,
        )
    _on_npu()
    ascend_utils._ascend_device_type = ascend_utils.AscendDeviceType.A5
    config = types.SimpleNamespace(
        enable_mlapo=True, enable_kv_nz=False
    )  # the defaults
    ascend_config.get_ascend_config = lambda: config
    mla_v1.get_ascend_config = ascend_config.get_ascend_config
    import vllm_ascend.attention.utils as attention_utils

    attention_utils.get_ascend_config = ascend_config.get_ascend_config
    assert enabling_mlapo(plain)  # on for every A5 instance

    register_npu_chunk_cache()
    rank, rope_dim, heads, nope, v_dim = 512, 64, 2, 32, 32
    gen = torch.Generator().manual_seed(0)
    impl = mla_v1.AscendMLAImpl.__new__(mla_v1.AscendMLAImpl)
    impl.num_heads, impl.num_kv_heads, impl.kv_lora_rank = heads, 1, rank
    impl.qk_nope_head_dim, impl.v_head_dim, impl.qk_rope_head_dim = (
        nope,
        v_dim,
        rope_dim,
    )
    impl.enable_mlapo = enabling_mlapo(plain)  # as AscendMLAImpl.__init__
    impl.fa_quant_layer = impl.enable_kv_nz = False
    impl.layer_sharding_kwargs = []
    impl.kv_b_proj = types.SimpleNamespace(
        quant_method=UnquantizedLinearMethod(),
        weight=torch.nn.Parameter(
            torch.randn(heads * (nope + v_dim), rank, generator=gen)
        ),
    )
    impl.fused_qkv_a_proj = types.SimpleNamespace(
        quant_method=UnquantizedLinearMethod()
    )
    impl.process_weights_after_loading(torch.float32)  # vllm-ascend's own decision
    assert impl.enable_mlapo is False

    layer = types.SimpleNamespace(
        impl=impl, kv_lora_rank=rank, qk_rope_head_dim=rope_dim, kv_cache_dtype="auto"
    )
    cache = (torch.zeros(2, 128, 1, rank), torch.zeros(2, 128, 1, rope_dim))
    writer = latent_writer_for(impl)
    support._check_latent_layer("model.layers.0.self_attn.attn", layer)
    latent = LatentLayer.of(
        "model.layers.0.self_attn.attn",
        layer,
        cache,
        RopeRotation(rope),
        writer,
        8,
        torch.float32,
    )
    assert latent.pool.shape == (8, rank + rope_dim)

    impl.enable_mlapo = True  # a W8A8 layer keeps it
    try:
        support._check_latent_layer("model.layers.1.self_attn.attn", layer)
    except ValueError as e:
        assert "model.layers.1.self_attn.attn" in str(e) and "MLAPO" in str(e), str(e)
    else:
        raise AssertionError("a layer with MLAPO was not refused")


def check_full_graph_refusal_names_the_npu_not_a_quantized_cache() -> None:
    """Finding 11: on the NPU platform an explicit full graph mode (vllm-ascend
    sets FULL_DECODE_ONLY itself under xlite decode-only) is refused because the
    platform's captures run in the attention hook; the message says so, instead of
    blaming a quantized KV cache the config does not have."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        configure_chunk_cache_connector,
    )

    config = _chunk_cache_config()
    assert str(config.cache_config.cache_dtype) == "auto"
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    _on_npu()
    try:
        configure_chunk_cache_connector(config)
    except ValueError as e:
        assert "FULL_DECODE_ONLY" in str(e) and "npu platform" in str(e), str(e)
        assert "quantized" not in str(e), str(e)
    else:
        raise AssertionError("FULL_DECODE_ONLY accepted on the NPU platform")


def check_sparse_mla_passes_the_config_on_the_npu_platform_only() -> None:
    """Issue 32: a DeepSeek-V3.2-style model (an indexer: `index_topk`) is refused when
    the config is built on vLLM's CPU platform, and passes it with vllm-ascend's
    NPUPlatform current (its SFA layers are then checked one by one when the worker
    builds them: npu_stub_checks.check_sfa_refusals)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import support

    model = types.SimpleNamespace(
        use_mla=True, hf_config=types.SimpleNamespace(index_topk=2048)
    )
    try:
        support._check_model_kind(model)
    except ValueError as e:
        assert "sparse MLA" in str(e) and "SFA" in str(e), str(e)
    else:
        raise AssertionError("sparse MLA accepted on the CPU platform")
    _on_npu()
    support._check_model_kind(model)


def _preamble() -> None:
    import vllm_ascend.ops  # noqa: F401 - vllm-ascend's own import order (device_op first)


if __name__ == "__main__":
    from check_batch import main

    main(
        globals(),
        preamble=_preamble,
        preload=(
            "vllm.config",
            "vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache",
        ),
    )
