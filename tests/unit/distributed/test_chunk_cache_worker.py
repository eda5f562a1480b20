# SPDX-License-Identifier: Apache-2.0
"""Worker side of the chunk cache without an engine (issue 7 finding 4, issue 8):
start-up refusals, which layers' keys are rotated, graph modes, pool sizing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import setup
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.layer_ropes import (
    find_layer_ropes,
    rope_use,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
    ChildStore,
    ChunkCacheMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
    POOL_BLOCK_SIZE,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    check_graph_mode,
    check_model_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.worker import (
    ChunkCacheWorker,
)


def _attention(name: str):
    from vllm.model_executor.layers.attention.attention import Attention

    layer = Attention.__new__(Attention)  # no engine config needed for the walk
    nn.Module.__init__(layer)
    layer.layer_name = name
    return layer


class _Rope(nn.Module):
    def forward(self, positions, q, k):
        return q, k


class UsesRope(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.rotary_emb = _Rope()
        self.attn = _attention(name)

    def forward(self, positions, q, k):
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k)


class KeepsUnusedRope(nn.Module):
    """A NoPE layer that still holds a rotary_emb (built for every layer)."""

    def __init__(self, name):
        super().__init__()
        self.rotary_emb = _Rope()
        self.attn = _attention(name)

    def forward(self, positions, q, k):
        return self.attn(q, k)


class ConditionalRope(nn.Module):
    """Applies its rope on some layers only (Exaone4-style)."""

    def __init__(self, name, use):
        super().__init__()
        self.rotary_emb = _Rope()
        self.use_rope = use
        self.attn = _attention(name)

    def forward(self, positions, q, k):
        if self.use_rope:
            q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k)


def test_rope_use_is_read_from_the_forward():
    assert rope_use(UsesRope("a")) == "always"
    assert rope_use(KeepsUnusedRope("a")) == "never"
    # Issue 42: a flag the module holds decides the branch (before: "conditional").
    assert rope_use(ConditionalRope("a", True)) == "always"
    assert rope_use(ConditionalRope("a", False)) == "never"


def test_a_layer_that_keeps_an_unused_rotary_emb_is_not_rotated():
    model = nn.ModuleList([UsesRope("l0"), KeepsUnusedRope("l1")])
    ropes, orphans = find_layer_ropes(model)
    assert ropes["l0"] is model[0].rotary_emb
    # Before: l1 was mapped to its rotary_emb and its keys rotated anyway.
    assert ropes["l1"] is None
    assert orphans == ["l1"]  # the worker refuses a model mixing both


def test_a_rope_applied_under_a_flag_is_decided_per_layer():
    """Issue 42, deliverable 3: the test reads the module's own state, so each
    layer's branch is known; a layer that skips its rope is still an orphan in
    a model with RoPE elsewhere (refused by the worker, as before)."""
    model = nn.ModuleList([ConditionalRope("l0", True), ConditionalRope("l1", False)])
    ropes, orphans = find_layer_ropes(model)
    assert ropes == {"l0": model[0].rotary_emb, "l1": None} and orphans == ["l1"]
    ropes, orphans = find_layer_ropes(nn.ModuleList([ConditionalRope("l0", True)]))
    assert ropes == {"l0": ropes["l0"]} and ropes["l0"] is not None and not orphans


class OlmoHybridStyle(nn.Module):
    """vLLM's OLMo hybrid attention: `_use_rope` from the config, the rope
    applied under it; also through a conditional expression."""

    def __init__(self, name, use, expression=False):
        super().__init__()
        self._use_rope = use
        self.expression = expression
        self.rotary_emb = _Rope() if use else None
        self.attn = _attention(name)

    def forward(self, positions, q, k):
        if self._use_rope and not self.expression:
            q, k = self.rotary_emb(positions, q, k)
        q, k = self.rotary_emb(positions, q, k) if self.expression else (q, k)
        return self.attn(q, k)


class FlagSetInForward(ConditionalRope):
    def forward(self, positions, q, k):
        self.use_rope = positions.numel() > 1
        if self.use_rope:
            q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k)


class TensorFlag(ConditionalRope):
    def __init__(self, name):
        super().__init__(name, True)
        self.use_rope = torch.tensor(True)


class InputTest(ConditionalRope):
    def forward(self, positions, q, k):
        if positions.numel() > 0 and self.use_rope:
            q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k)


def test_module_state_decides_only_unambiguous_tests():
    assert rope_use(OlmoHybridStyle("a", True)) == "always"
    assert rope_use(OlmoHybridStyle("a", True, expression=True)) == "always"
    model = nn.ModuleList(
        [OlmoHybridStyle("l0", True), OlmoHybridStyle("l1", True, True)]
    )
    ropes, orphans = find_layer_ropes(model)
    assert all(ropes[n] is model[i].rotary_emb for i, n in enumerate(("l0", "l1")))
    assert not orphans
    # Undecided (refused as before): a flag the forward assigns, a tensor's
    # truth, a test on the input.
    for module in (FlagSetInForward("a", True), TensorFlag("a"), InputTest("a", True)):
        assert rope_use(module) == "conditional", type(module).__name__
        with pytest.raises(
            ValueError, match=f"cannot tell whether {type(module).__name__}"
        ):
            find_layer_ropes(nn.ModuleList([module]))


def test_nope_layer_configs_are_refused():
    check_model_config(SimpleNamespace(num_hidden_layers=2))
    with pytest.raises(ValueError, match="no_rope_layers"):
        check_model_config(SimpleNamespace(no_rope_layers=[1, 0, 1]))


def _worker(fraction=0.15):
    chunk = SimpleNamespace(
        chunk_pool_fraction=fraction,
        chunk_pool_size_gib=None,
        max_chunk_load_tokens=64,
        chunk_store=None,
        chunk_recompute_tokens=0,
    )
    model = SimpleNamespace(dtype=torch.float32)
    vllm_config = SimpleNamespace(
        chunk_cache_config=chunk,
        model_config=model,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        compilation_config=SimpleNamespace(),
        # NOTE: the start-up reads max_num_seqs (the cap of a
        # step's attention rows under full graphs, issue 60).
        scheduler_config=SimpleNamespace(max_num_seqs=8),
    )
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))
    return ChunkCacheWorker(
        vllm_config, SimpleNamespace(kv_cache_groups=[group], num_blocks=64)
    )


class _NoRopeAttention(nn.Module):
    """Attention that holds no rotary_emb (GPT-2's learned positions, or the
    Transformers backend's layers, whose rope lives in transformers' code)."""

    def __init__(self, name):
        super().__init__()
        self.attn = _attention(name)


def _no_rope_model(module_name):
    cls = type("TransformersForCausalLM", (nn.ModuleList,), {"__module__": module_name})
    return cls([_NoRopeAttention("l0"), _NoRopeAttention("l1")])


def test_a_model_on_the_transformers_backend_is_refused_by_name():
    """Issue 42: vLLM 0.32 serves OLMo 2 through its Transformers modeling
    backend; its layers have no rope of vLLM's, which must not read as "a model
    without RoPE" (a different reason) nor be served unrotated."""
    worker = _worker()
    model = _no_rope_model("vllm.model_executor.models.transformers.causal")
    with pytest.raises(
        ValueError,
        match=r"Transformers modeling backend "
        r"\(TransformersForCausalLM\).*unsupported model implementation",
    ):
        worker.register_model(model)
    # The same layers in a model of vLLM's own: refused as a model without RoPE.
    with pytest.raises(ValueError, match=r"\['l0', 'l1'\] have no rotary embedding"):
        worker.register_model(_no_rope_model("vllm.model_executor.models.gpt2"))


def test_start_up_is_refused_when_the_runner_never_registered_the_model():
    worker = _worker()
    # Before: a warning, then keys loaded without rotation (wrong answers).
    with pytest.raises(RuntimeError, match="did not call register_model"):
        worker.register_kv_caches({"l0": torch.zeros(4, 2, 16, 2, 8)})


def test_graph_modes_constrain_only_layers_captured_in_the_attention_hook():
    from vllm.config.compilation import CUDAGraphMode

    attn = ["vllm::unified_attention_with_output"]
    hooked = {"l3": "quantized KV cache (fp8)"}
    # Every capture after the forward: full graphs stay (issue 21).
    for mode in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE):
        check_graph_mode(SimpleNamespace(cudagraph_mode=mode, splitting_ops=[]), {})
    check_graph_mode(SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE), hooked)
    check_graph_mode(
        SimpleNamespace(cudagraph_mode=CUDAGraphMode.PIECEWISE, splitting_ops=attn),
        hooked,
    )
    with pytest.raises(ValueError, match=r"FULL.*l3.*fp8"):
        check_graph_mode(
            SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL, splitting_ops=attn),
            hooked,
        )
    with pytest.raises(ValueError, match="splitting_ops"):
        check_graph_mode(
            SimpleNamespace(cudagraph_mode=CUDAGraphMode.PIECEWISE, splitting_ops=[]),
            hooked,
        )


@pytest.mark.parametrize(
    "cache_dtype,hooked",
    [("auto", False), ("bfloat16", False), ("fp8", True), ("fp8_e4m3", True)],
)
def test_full_graphs_stay_unless_the_cache_is_quantized(cache_dtype, hooked):
    """VLLM's default FULL_AND_PIECEWISE stays where captures run after the
    forward; a quantized cache keeps the hook, so PIECEWISE (logged), and an
    explicit FULL is refused there."""
    from vllm.config import ChunkCacheConfig
    from vllm.config.compilation import CUDAGraphMode

    cfg = SimpleNamespace(
        chunk_cache_config=ChunkCacheConfig(
            enable_chunk_cache=True, chunk_context="none"
        ),
        cache_config=SimpleNamespace(kv_offloading_size=None, cache_dtype=cache_dtype),
        compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE
        ),
        kv_transfer_config=None,
        model_config=None,
    )
    setup.configure_chunk_cache_connector(cfg)
    extra = cfg.kv_transfer_config.kv_connector_extra_config
    assert extra == {"capture_in_attention": hooked}
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.connector import (
        ChunkCacheConnector,
    )

    assert ChunkCacheConnector.requires_piecewise_for_cudagraph(extra) is hooked
    assert cfg.compilation_config.cudagraph_mode == (
        CUDAGraphMode.PIECEWISE if hooked else CUDAGraphMode.FULL_AND_PIECEWISE
    )
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    cfg.kv_transfer_config = None
    if hooked:
        with pytest.raises(ValueError, match="FULL_DECODE_ONLY.*quantized"):
            setup.configure_chunk_cache_connector(cfg)
    else:
        setup.configure_chunk_cache_connector(cfg)


class _Model(SimpleNamespace):
    def get_num_layers(self, parallel_config):
        return 30

    def get_num_kv_heads(self, parallel_config):
        return 3

    def get_head_size(self):
        return 64


def _sizing_config(cache_dtype="auto", fraction=0.15, size_gib=None):
    return SimpleNamespace(
        chunk_cache_config=SimpleNamespace(
            chunk_pool_fraction=fraction,
            chunk_pool_size_gib=size_gib,
            max_chunk_load_tokens=4096,
        ),
        model_config=_Model(dtype=torch.bfloat16),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        parallel_config=None,
    )


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("fraction,size_gib", [(0.15, None), (0.5, None), (None, 1.0)])
def test_pool_is_carved_out_of_the_kv_budget(cache_dtype, fraction, size_gib):
    """The paged KV capacity shrinks by the pool's size plus the load
    buffers', and the total stays within the budget (the sizing vLLM's
    get_kv_cache_configs then applies: whole blocks of block_size tokens in
    the budget it is given)."""
    cfg = _sizing_config(cache_dtype, fraction or 0.15, size_gib)
    budget, block = 4 << 30, 16
    kv_token = setup.kv_bytes_per_token(cfg)
    pool_token = setup.pool_bytes_per_token(cfg)
    assert pool_token == 30 * 3 * 64 * 2 * 2  # sized in bf16, the pool's dtype
    assert kv_token == pool_token // (2 if cache_dtype == "fp8" else 1)
    stock_blocks = budget // (block * kv_token)
    blocks = setup.carve_chunk_pool(cfg, budget) // (block * kv_token)
    pool = setup._pool_blocks(cfg, blocks, block) * setup.POOL_BLOCK_SIZE * pool_token
    kv = blocks * block * kv_token
    # The load buffers: 4096 rows of K, V and the rotated K in bf16, and two
    # fp32 copies of K (3 KV heads x 64), allocated once per worker.
    scratch = setup.load_scratch_bytes(cfg)
    assert scratch == 4096 * (3 * 192 * 2 + 2 * 192 * 4)
    assert kv + pool + scratch <= budget
    shrink = (stock_blocks - blocks) * block * kv_token
    slack = block * kv_token + setup.POOL_BLOCK_SIZE * pool_token
    if size_gib is not None:
        # Shrinks by the pool's size and the buffers', up to the rounding of
        # one block and one pool block on each side.
        assert abs(shrink - (1 << 30) - scratch) <= 2 * slack
        assert abs(pool - (1 << 30)) <= slack
    else:
        # f of what the buffers leave for the pool.
        assert abs(pool - fraction * (budget - scratch)) <= 2 * slack
        assert abs(shrink - pool - scratch) <= 2 * slack


def test_a_pool_larger_than_the_budget_is_refused():
    cfg = _sizing_config(size_gib=8.0)
    with pytest.raises(ValueError, match="do not fit the KV cache budget"):
        setup.carve_chunk_pool(cfg, 4 << 30)


def test_pool_device_is_the_paged_cache_device_for_tensor_and_pair_caches():
    """VLLM's backends keep one tensor per layer, vllm-ascend a (key, value) pair."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.worker import (
        cache_device,
    )

    one = torch.zeros(2, 3, device="meta")
    assert cache_device(one) == torch.device("meta")
    assert cache_device((one, one.clone())) == torch.device("meta")
    assert cache_device([torch.zeros(1), torch.zeros(1)]) == torch.device("cpu")


def test_sparse_mla_is_refused_at_start_up():
    from vllm.config import ChunkCacheConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        configure_chunk_cache_connector,
    )

    config = SimpleNamespace(
        chunk_cache_config=ChunkCacheConfig(enable_chunk_cache=True),
        cache_config=SimpleNamespace(kv_offloading_size=None),
        kv_transfer_config=None,
        model_config=SimpleNamespace(
            use_mla=True,
            is_multimodal_model=False,
            hf_config=SimpleNamespace(index_topk=2048),
        ),
    )
    with pytest.raises(ValueError, match="sparse MLA.*vllm-ascend's SFA"):
        configure_chunk_cache_connector(config)


def test_capture_indices_read_nothing_back_to_the_host(monkeypatch):
    """Issue 20, finding 4. Before: `bool((slots[rows] == wanted).all())` in
    every step with a child, a device->host read that serialises CPU and GPU
    under async scheduling. Now a device-side assertion: no Python-level read
    of a tensor's value, and a slot missing from the batch still raises."""
    # A child of blocks (2, 0) of 4 slots computes positions 1..4 (slots 9,
    # 10, 11, 0) and stores them from position 1 on: rows 0..3 of pool block 10.
    store = ChildStore(
        block_ids=(2, 0),
        pool_block_ids=(10,),
        first_position=1,
        end_position=5,
        store_start=1,
    )
    worker = SimpleNamespace(block_size=4)
    slot_mapping = torch.tensor([7, 9, 10, 11, 0, 13], dtype=torch.int32)

    def host_read(*args):
        raise AssertionError("a tensor's value was read on the host")

    with monkeypatch.context() as m:
        for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
            m.setattr(torch.Tensor, name, host_read)
        rows, dst = ChunkCacheWorker._capture_indices(
            worker, ChunkCacheMetadata(stores=[store]), slot_mapping
        )
    first = 10 * POOL_BLOCK_SIZE
    assert rows.tolist() == [1, 2, 3, 4]
    assert dst.tolist() == [first, first + 1, first + 2, first + 3]
    missing = ChildStore(
        block_ids=(1,),
        pool_block_ids=(0,),
        first_position=0,
        end_position=1,
        store_start=0,
    )  # slot 4: not in the batch
    with pytest.raises(RuntimeError, match="not in this step's batch"):
        ChunkCacheWorker._capture_indices(
            worker, ChunkCacheMetadata(stores=[missing]), slot_mapping
        )


def test_an_mla_pool_token_is_one_latent_row_per_layer():
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        kv_bytes_per_token,
        pool_bytes_per_token,
    )

    config = _sizing_config()
    assert pool_bytes_per_token(config) == 30 * 3 * 64 * 2 * 2  # K and V, bf16
    config.model_config.use_mla = True
    # MLA: the latent row alone, as vLLM's MLAAttentionSpec pages it (no V).
    assert pool_bytes_per_token(config) == kv_bytes_per_token(config) == 30 * 3 * 64 * 2


def test_a_rope_narrower_than_the_key_heads_is_refused(vllm_config_context):
    """A rope built for part of a head (non-MLA DeepSeek attention puts k_pe at the end
    of a 192-wide head) would be turned at the head's start: refused at start-up, by
    name."""
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.position_remapper import RopeRotation

    class CPUAttentionBackendImpl:  # the name the CPU writer is registered under
        kv_cache_dtype = "auto"

    layer = _attention("l0")
    layer.impl = CPUAttentionBackendImpl()
    layer.num_kv_heads, layer.head_size, layer.head_size_v = 1, 192, 128
    layer.sliding_window = None
    layer.kv_sharing_target_layer_name = None
    rope = get_rope(64, 4096, True, {"rope_type": "default"}, torch.float32)
    worker = _worker()
    worker.vllm_config.compilation_config.static_forward_context = {"l0": layer}
    worker._ropes = {"l0": rope}
    worker._rotations = {id(rope): RopeRotation(rope, use_cpu_kernel=False)}
    with pytest.raises(
        ValueError, match=r"l0 rotates heads of 64 values but its keys have 192"
    ):
        worker.register_kv_caches({"l0": torch.zeros(4, 1, 16, 2 * 192)})


def _two_hooked_layers_and_a_child_step():
    """A worker whose layers l0 and l1 capture in the attention hook, and one
    step's metadata with a child storing 4 rows (slots 8-11 -> pool block 1)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.capture_path import (
        CaptureChoice,
    )

    worker = _worker()
    worker.block_size = 4
    worker._capture = CaptureChoice(in_attention={"l0": "hook", "l1": "hook"})
    for name in ("l0", "l1"):
        worker.pool_key[name] = torch.zeros(64, 1, 2)
        worker.pool_value[name] = torch.zeros(64, 1, 2)
    store = ChildStore(
        block_ids=(2,),
        pool_block_ids=(1,),
        first_position=0,
        end_position=4,
        store_start=0,
    )
    return (
        worker,
        ChunkCacheMetadata(stores=[store]),
        torch.tensor([8, 9, 10, 11]),
        torch.arange(8.0).view(4, 1, 2),
    )


def test_a_step_with_captures_fails_if_a_hooked_layer_never_captured():
    """Issue 29, finding 4. Before: a layer whose attention ran outside vLLM's
    wrapper (vllm-ascend's xlite full mode) never reached save_kv_layer, the
    step went on and parents later loaded the pool's zeros. Now the step that
    had captures to make fails, naming the layer."""
    worker, meta, slot_mapping, rows = _two_hooked_layers_and_a_child_step()

    worker.start_load_kv(meta, None)
    worker.save_kv_layer(meta, "l0", slot_mapping, rows, rows + 1)
    with pytest.raises(
        RuntimeError, match=r"layer\(s\) \['l1'\] \(1 of 2\) never reached"
    ):
        worker.capture_after_forward(meta)
    # Every hooked layer captured: the step goes on; a step without captures
    # checks nothing.
    worker.start_load_kv(meta, None)
    for name in ("l0", "l1"):
        worker.save_kv_layer(meta, name, slot_mapping, rows, rows + 1)
    worker.capture_after_forward(meta)
    assert torch.equal(
        worker.pool_key["l1"][POOL_BLOCK_SIZE : POOL_BLOCK_SIZE + 4], rows
    )
    worker.start_load_kv(ChunkCacheMetadata(), None)
    worker.capture_after_forward(ChunkCacheMetadata())


def test_the_hooks_captures_count_when_the_step_starts_its_loads_after_the_forward():
    """VLLM 0.32 calls start_load_kv after the forward in a step without
    synchronous loads (kv_connector_model_runner_mixin: start_after_forward).
    Before: start_load_kv forgot the hook's captures and every such step with
    captures failed ("4 of 4 never reached the capture hook", CI on 0.32). The
    captures belong to the step's metadata, whatever the order of the calls."""
    worker, meta, slot_mapping, rows = _two_hooked_layers_and_a_child_step()
    for name in ("l0", "l1"):
        worker.save_kv_layer(meta, name, slot_mapping, rows, rows + 1)
    worker.start_load_kv(meta, None)  # after the forward, as 0.32 orders it
    worker.capture_after_forward(meta)
    assert torch.equal(
        worker.pool_value["l0"][POOL_BLOCK_SIZE : POOL_BLOCK_SIZE + 4], rows + 1
    )
    # The next step's metadata starts with nothing captured.
    nxt = ChunkCacheMetadata(stores=meta.stores)
    worker.save_kv_layer(nxt, "l0", slot_mapping, rows, rows + 1)
    with pytest.raises(RuntimeError, match=r"\['l1'\] \(1 of 2\) never reached"):
        worker.capture_after_forward(nxt)


class _OtherRope(_Rope):
    pass


class TypeTestedRope(nn.Module):
    """A forward whose rope use depends on the rope's class (vllm-ascend's
    patch_qwen3vl forward of Qwen3 attention: a fused path for an M-RoPE)."""

    def __init__(self, name, rope):
        super().__init__()
        self.rotary_emb = rope
        self.attn = _attention(name)

    def forward(self, positions, q, k):
        if isinstance(self.rotary_emb, _OtherRope):
            q = self.rotary_emb.cos_sin_cache[positions]
        else:
            q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k)


class UnknownTypeTested(TypeTestedRope):
    def forward(self, positions, q, k):
        if isinstance(self.rotary_emb, NotAName):  # noqa: F821 - never resolved
            return q
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k)


def test_an_isinstance_test_of_the_rope_is_decided_for_the_layers_rope():
    """Issue 29, finding 2. Before: any `if` on the rope made its use
    "conditional" and Qwen3 on Ascend was refused. Now the branch taken with this
    layer's rope is read as unconditional, the other one as dead; a class the
    forward's module does not name stays undecided."""
    assert rope_use(TypeTestedRope("a", _Rope())) == "always"
    assert (
        rope_use(TypeTestedRope("a", _OtherRope())) == "always"
    )  # mentioned, not called
    assert rope_use(UnknownTypeTested("a", _Rope())) == "conditional"
    model = nn.ModuleList(
        [TypeTestedRope("l0", _Rope()), TypeTestedRope("l1", _Rope())]
    )
    ropes, orphans = find_layer_ropes(model)
    assert (
        ropes == {"l0": model[0].rotary_emb, "l1": model[1].rotary_emb} and not orphans
    )
