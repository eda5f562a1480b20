# SPDX-License-Identifier: Apache-2.0
"""The worker's device state across vLLM's sleep, on the CPU (issue 30, finding 1).

On a GPU, vLLM's worker runs `initialize_kv_cache` (and with it the connector's
`register_kv_caches`) inside its CuMem pool tagged "kv_cache"; `sleep(level >= 1)`
discards that memory and `wake_up` maps fresh memory at the same addresses. The CPU
worker discards nothing, so the e2e sleep test cannot show what a GPU would. Here the
same mechanism runs on the CPU: every tensor produced while `register_kv_caches` runs is
recorded (a TorchDispatchMode standing for the pool), the "sleep" zeroes all of them
(and the paged caches, which live in that pool too), new rows are captured as after a
wake-up, and the next load must write what vLLM's own RoPE gives at the real positions.

The layers are standard attention with the FlashAttention implementation's name, so that
the fused Triton load is chosen (it runs in Triton's interpreter on CPU tensors); their
cache write, which the fused path's self-check compares with and the layers not fused
use, is vLLM's own Triton `triton_reshape_and_cache_flash` (also interpreted). Not
executed on a GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton compiles anything

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
    ChunkCacheMetadata,
    RequestLoad,
    SegmentStretch,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
    POOL_BLOCK_SIZE,
)

from tests.unit.distributed.test_chunk_cache_worker import _worker
from tests.unit.vllm_triton_cache_write import write_kv

HEADS, HEAD, BLOCK, BLOCKS, LAYERS = 2, 32, 16, 64, 3


class FlashAttentionImpl:
    """What the worker reads of vLLM's FlashAttention implementation; its cache write is
    vLLM's Triton twin of reshape_and_cache_flash
    (tests/unit/vllm_triton_cache_write.py)."""

    kv_cache_dtype = "auto"

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        write_kv(kv_cache, key, value, slot_mapping)


def _attention(name: str, kv_cache: torch.Tensor):
    from vllm.model_executor.layers.attention.attention import Attention

    layer = Attention.__new__(Attention)  # no engine config needed
    nn.Module.__init__(layer)
    layer.layer_name = name
    layer.impl = FlashAttentionImpl()
    layer.num_kv_heads, layer.head_size, layer.head_size_v = HEADS, HEAD, HEAD
    layer.sliding_window = None
    layer.kv_sharing_target_layer_name = None
    layer._k_scale = torch.ones(1)
    layer._v_scale = torch.ones(1)
    layer.kv_cache = kv_cache
    return layer


class Block(nn.Module):
    def __init__(self, rope, attn):
        super().__init__()
        self.rotary_emb = rope
        self.attn = attn

    def forward(self, positions, q, k):
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k)


class KVCachePool(TorchDispatchMode):
    """Stands for vLLM's CuMem pool tagged "kv_cache": keeps every tensor an op produces
    while active, and `discard` zeroes their memory, as a sleep leaves it on a GPU."""

    def __init__(self):
        super().__init__()
        self.tensors: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tensors += [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def discard(self) -> None:
        for tensor in self.tensors:
            tensor.untyped_storage().fill_(0)


@pytest.fixture
def engine(vllm_config_context):
    return _engine()


def _engine():
    """A worker registered as vLLM's runner registers it, with its start-up inside the
    emulated pool."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rope = get_rope(
        HEAD, 4096, True, {"rope_type": "default", "rope_theta": 10000}, torch.float32
    )
    caches = {
        f"l{i}": torch.zeros(BLOCKS, 2, BLOCK, HEADS, HEAD) for i in range(LAYERS)
    }
    layers = {name: _attention(name, cache) for name, cache in caches.items()}
    worker = _worker()
    worker.vllm_config.compilation_config.static_forward_context = layers
    worker.register_model(
        nn.ModuleList([Block(rope, layer) for layer in layers.values()])
    )
    pool = KVCachePool()
    with pool:
        worker.register_kv_caches(caches)
    return SimpleNamespace(
        worker=worker, rope=rope, layers=layers, caches=caches, pool=pool
    )


def _rope_keys(rope, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """VLLM's own RoPE of `keys` [n, heads, head] at `positions`."""
    flat = keys.reshape(keys.shape[0], -1)
    _, rotated = rope.forward_native(positions, flat.clone(), flat.clone())
    return rotated.view_as(keys)


def _serve(engine, seed: int) -> None:
    """Capture random rows at their stored positions (as a child computes them) into the
    pool, load two requests' stretches, and compare every layer's paged rows with vLLM's
    RoPE at the real positions (V copied as is)."""
    worker, rope = engine.worker, engine.rope
    gen = torch.Generator().manual_seed(seed)
    stretches = [
        ((2, 3), 0, 20, 5, 300),
        ((6,), 3, 9, 30, -2),
        ((7, 8), 0, 25, 0, 4000),
    ]
    loads = [
        RequestLoad(
            block_ids=(3, 4, 5),
            stretches=tuple(SegmentStretch(*s) for s in stretches[:2]),
        ),
        RequestLoad(block_ids=(9, 10), stretches=(SegmentStretch(*stretches[2]),)),
    ]
    expected = {}
    for name in engine.layers:
        keys, values = {}, {}
        for i, (pool_blocks, first, count, dst, delta) in enumerate(stretches):
            raw = torch.randn(count, HEADS, HEAD, generator=gen)
            value = torch.randn(count, HEADS, HEAD, generator=gen)
            stored = torch.arange(first, first + count) + 1  # positions the child had
            pool_rows = torch.tensor(
                [
                    pool_blocks[(first + j) // POOL_BLOCK_SIZE] * POOL_BLOCK_SIZE
                    + (first + j) % POOL_BLOCK_SIZE
                    for j in range(count)
                ]
            )
            worker.pool_key[name][pool_rows] = _rope_keys(rope, raw, stored)
            worker.pool_value[name][pool_rows] = value
            keys[i] = _rope_keys(rope, raw, stored + delta)
            values[i] = value
        expected[name] = (keys, values)
    layers = engine.layers
    worker.start_load_kv(
        ChunkCacheMetadata(loads=loads),
        SimpleNamespace(no_compile_layers=layers, attn_metadata=None),
    )
    for name, cache in engine.caches.items():
        key_cache, value_cache = cache.unbind(1)
        keys, values = expected[name]
        i = 0
        for load in loads:
            for stretch in load.stretches:
                positions = torch.arange(
                    stretch.dst_position, stretch.dst_position + stretch.num_rows
                )
                blocks = torch.tensor(load.block_ids)[positions // BLOCK]
                got_k = key_cache[blocks, positions % BLOCK]
                got_v = value_cache[blocks, positions % BLOCK]
                # NOTE: vLLM's RoPE takes fp32 angles from its cos/sin cache (~1e-4 at
                # position 4,000), the load float64 ones; keys at a wrong angle differ
                # by O(1).
                torch.testing.assert_close(
                    got_k,
                    keys[i],
                    atol=1e-3,
                    rtol=1e-3,
                    msg=lambda m, n=name, i=i: f"{n} stretch {i}: {m}",
                )
                assert torch.equal(got_v, values[i]), (name, i)
                i += 1


def test_a_load_after_a_sleep_discarded_the_kv_cache_pool_is_exact(engine):
    """Serve, sleep (every tensor register_kv_caches made is zeroed, as vLLM's CuMem
    pool leaves it), wake up, serve again: exact both times. Before: the fused kernel's
    address table was built in register_kv_caches (zeroed by the sleep: the next load
    dereferenced null addresses) and the RoPE frequencies' device copy made by the
    start-up self-check was reused by every load (zeroed: cos 1, sin 0, keys loaded at
    their stored position). (A garbage table crashes the process: pytest's fault handler
    names this test.)"""
    assert engine.worker._fused.layers, engine.worker._fused.summary()  # the fused path
    _serve(engine, seed=1)
    engine.pool.discard()  # sleep(level=1) on a GPU; wake_up maps the same addresses
    for cache in engine.caches.values():
        assert not cache.any()  # the paged caches were allocated in the pool too
    _serve(engine, seed=2)


def _reachable_tensors(root) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through attributes, dicts, lists, tuples and
    sets (modules' parameters and buffers included)."""
    seen, found, todo = set(), [], [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(
            obj, (str, bytes, int, float, bool, type(None))
        ):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            todo += list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            todo += list(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            todo += [getattr(obj, n) for n in obj.__slots__ if hasattr(obj, n)]
    return found


def test_the_worker_keeps_nothing_made_in_the_pool_but_pools_buffers_and_caches(engine):
    """What the worker holds after register_kv_caches, whatever a load reads: of the
    memory made inside the emulated pool, only its pools, its load buffers and the paged
    caches' (their contents are rewritten or forgotten after a wake-up). Before the fix
    the fused kernel's address table was among them."""
    worker = engine.worker
    # NOTE: by storage (views share it); the pool keeps its tensors alive, so no other
    # storage can have their address. Empty storages hold nothing a sleep could discard.
    made = {
        t.untyped_storage().data_ptr()
        for t in engine.pool.tensors
        if t.untyped_storage().nbytes()
    }
    allowed = {
        t.untyped_storage().data_ptr()
        for t in (
            *worker.pool_key.values(),
            *worker.pool_value.values(),
            *engine.caches.values(),
            *worker._scratch._buffers.values(),
            *(latent.pool for latent in worker.latent.values()),
        )
    }
    kept = [
        tuple(t.shape)
        for t in _reachable_tensors(worker)
        if t.untyped_storage().data_ptr() in made - allowed
    ]
    assert not kept, kept


def test_a_load_after_a_sleep_is_exact_on_the_layer_by_layer_path(
    vllm_config_context, monkeypatch
):
    """The same sleep on the path the layers the fused kernel turns away take (every GPU
    layer whose self-check fails, and MLA's latent rows): the load buffers allocated in
    register_kv_caches are zeroed with the rest, and the next load, which rewrites them
    before it reads them, is exact."""
    monkeypatch.setenv(
        "TRITON_INTERPRET", "0"
    )  # no fused kernel: every layer per layer
    engine = _engine()
    assert not engine.worker._fused.layers and engine.worker._scratch.nbytes() > 0
    _serve(engine, seed=4)
    engine.pool.discard()
    assert not any(buffer.any() for buffer in engine.worker._scratch._buffers.values())
    _serve(engine, seed=5)


def test_the_load_buffers_are_allocated_at_start_up_for_the_layers_that_take_them(
    vllm_config_context, monkeypatch
):
    """Issue 30 finding 5, issue 29 finding 10: the buffers are allocated in
    register_kv_caches (inside the KV-cache pool the carve-out counts), for the layers
    that load through them, and a load allocates none. Before: allocated at the first
    load (outside the pool), and for every kind. Fused layers take none."""
    fused = _engine()
    assert fused.worker._fused.layers and fused.worker._scratch.nbytes() == 0
    monkeypatch.setenv(
        "TRITON_INTERPRET", "0"
    )  # no fused kernel: every layer per layer
    engine = _engine()
    scratch = engine.worker._scratch
    assert not engine.worker._fused.layers
    buffers = {key: buffer.data_ptr() for key, buffer in scratch._buffers.items()}
    # K, V and the rotated K of 64 rows (fp32 pool: no fp32 copies).
    assert sorted(role for role, *_ in buffers) == ["key", "rotated", "value"]
    assert scratch.nbytes() == 64 * 3 * HEADS * HEAD * 4
    _serve(engine, seed=3)
    assert {
        key: buffer.data_ptr() for key, buffer in scratch._buffers.items()
    } == buffers


def test_the_fused_self_check_runs_the_steps_launch_over_every_layer(
    vllm_config_context, monkeypatch
):
    """Issue 30 "Also": the self-check covers the launch the step makes: all the layers
    of a group through one table, several stretches. A table whose entries point layer 1
    at layer 0's pool (a fault of the multi-layer table only) keeps every layer of the
    group off the fused kernel. Before: a one-layer check per layer could not see it."""
    from vllm.v1.worker import fused_chunk_load

    of = fused_chunk_load.FusedGroup.of

    def crossed(pool_keys, pool_values, layers):
        if len(pool_keys) > 1:
            pool_keys = [pool_keys[0], pool_keys[0], *pool_keys[2:]]
        return of(pool_keys, pool_values, layers)

    monkeypatch.setattr(fused_chunk_load.FusedGroup, "of", crossed)
    engine = _engine()
    choice = engine.worker._fused
    assert not choice.layers, choice.summary()
    assert "bytes differ on l1" in choice.reasons["l0"]
