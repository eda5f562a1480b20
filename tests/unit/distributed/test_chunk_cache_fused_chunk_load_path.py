# SPDX-License-Identifier: Apache-2.0
"""The start-up choice of the fused load (fused_chunk_load_path.py), on the CPU.

The self-check runs the fused kernel with Triton's interpreter and, as the
backend's write, vLLM's own Triton `triton_reshape_and_cache_flash` under the same
interpreter (tests/unit/vllm_triton_cache_write.py): the CUDA op has no CPU
kernel. The fp8 case needs the CUDA op itself (the interpreter is no fp8
oracle): GPU-only, not executed here. The layer objects are stand-ins carrying
what the check reads (the implementation's class name, head counts, k/v
scales); the engine path on the CPU never takes the fused kernel, which the last
test shows through `choose_fused_layers`.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton compiles anything

from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.fused_chunk_load_path import (  # noqa: E501
    FusedLayers,
    FusedLoadChoice,
    choose_fused_layers,
    group_fused_layers,
    paged_layer,
    self_check_launch,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.sample_check import (
    SAMPLE_ROWS,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.v1.worker.position_remapper import RopeRotation

from tests.unit.vllm_triton_cache_write import write_kv

HEADS, HEAD, BLOCK, BLOCKS = 2, 32, 16, 6


class FlashAttentionImpl:  # the name the fused path knows; what the check reads
    def __init__(self, kv_cache_dtype="auto"):
        self.kv_cache_dtype = kv_cache_dtype


class FlexAttentionImpl(FlashAttentionImpl):
    pass


def layer(impl=None, head_v=HEAD):
    return SimpleNamespace(
        impl=impl or FlashAttentionImpl(),
        num_kv_heads=HEADS,
        head_size=HEAD,
        head_size_v=head_v,
        _k_scale=torch.tensor([0.03]),
        _v_scale=torch.tensor([0.02]),
    )


def kv_cache(dtype, hnd=False, device="cpu"):
    """[blocks, 2, block_size, heads, head], NHD or with FlashInfer's HND strides."""
    if not hnd:
        return torch.randn(BLOCKS, 2, BLOCK, HEADS, HEAD).to(dtype).to(device)
    return (
        torch.randn(BLOCKS, 2, HEADS, BLOCK, HEAD).to(dtype).to(device).transpose(2, 3)
    )


def backend_write(fp8=False):
    """VLLM's own cache write: its Triton op on the CPU, its CUDA op for fp8 (GPU)."""

    def write(layer, key, value, cache, slots):
        if not fp8:
            write_kv(cache, key, value, slots)
            return
        from vllm import _custom_ops as ops

        key_cache, value_cache = cache.view(torch.float8_e4m3fn).unbind(1)
        ops.reshape_and_cache_flash(
            key,
            value,
            key_cache,
            value_cache,
            slots,
            "fp8",
            layer._k_scale,
            layer._v_scale,
        )

    return write


@pytest.fixture(scope="module")
def rotation(vllm_config_context):
    return RopeRotation(
        get_rope(HEAD, 4096, False, {"rope_type": "default"}, torch.float32),
        use_cpu_kernel=False,
    )


GPU_ONLY = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="GPU-only: the fp8 oracle is vLLM's CUDA reshape_and_cache_flash (Triton's "
    "interpreter does not round to fp8 as the GPU does)",
)


def self_check(the_layer, kv_cache, paged, rotation, pool_dtype, reference_write):
    """The start-up self-check of a launch of one layer, over pools of its own."""
    key = torch.zeros(
        (SAMPLE_ROWS, the_layer.num_kv_heads, the_layer.head_size),
        dtype=pool_dtype,
        device=kv_cache.device,
    )
    launch = FusedLayers(
        ("layer",), rotation, (key,), (torch.zeros_like(key),), (paged,)
    )
    return self_check_launch(
        launch, {"layer": the_layer}, {"layer": kv_cache}, pool_dtype, reference_write
    )


@pytest.mark.parametrize(
    "dtype, fp8, hnd",
    [
        (torch.float32, False, False),
        (torch.bfloat16, False, True),
        pytest.param(torch.uint8, True, False, marks=GPU_ONLY),
    ],
    ids=["fp32-NHD", "bf16-HND", "fp8-NHD"],
)
def test_self_check_passes_where_the_kernel_writes_the_backends_bytes(
    rotation, dtype, fp8, hnd
):
    the_layer = layer(FlashAttentionImpl("fp8" if fp8 else "auto"))
    cache = kv_cache(dtype, hnd, device="cuda" if fp8 else "cpu")
    if fp8:
        the_layer._k_scale, the_layer._v_scale = (
            the_layer._k_scale.cuda(),
            the_layer._v_scale.cuda(),
        )
    before = cache.clone()
    paged = paged_layer(the_layer, cache)
    assert not isinstance(paged, str), paged
    pool_dtype = torch.bfloat16 if dtype != torch.float32 else torch.float32
    assert (
        self_check(the_layer, cache, paged, rotation, pool_dtype, backend_write(fp8))
        is None
    )
    assert (
        self_check(the_layer, cache, paged, None, pool_dtype, backend_write(fp8))
        is None
    )
    assert torch.equal(
        cache.view(torch.uint8), before.view(torch.uint8)
    )  # left as it was


def test_self_check_names_a_difference_and_keeps_the_cache(rotation):
    the_layer = layer()
    cache = kv_cache(torch.bfloat16)
    before = cache.clone()
    paged = paged_layer(the_layer, cache)

    def rounds_differently(layer, key, value, cache, slots):
        # A backend that rounds differently from the kernel (one bf16 ulp on every key).
        write_kv(cache, key + key.abs() * 2**-8, value, slots)

    reason = self_check(
        the_layer, cache, paged, rotation, torch.bfloat16, rounds_differently
    )
    assert reason is not None and "bytes differ" in reason
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))

    def broken_backend(layer, key, value, cache, slots):
        raise RuntimeError("no kernel image")

    assert "RuntimeError: no kernel image" in self_check(
        the_layer, cache, paged, rotation, torch.bfloat16, broken_backend
    )
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def test_layers_the_kernel_does_not_know_keep_todays_path():
    cache = kv_cache(torch.bfloat16)
    assert "FlexAttentionImpl has no fused load" in paged_layer(
        layer(FlexAttentionImpl()), cache
    )
    assert "head sizes differ" in paged_layer(layer(head_v=16), cache)
    assert "fp8_e5m2" in paged_layer(layer(FlashAttentionImpl("fp8_e5m2")), cache)
    quant = FlashAttentionImpl()
    quant._is_per_token_head_quant = True
    assert "per-token-head" in paged_layer(layer(quant), cache)
    fp8 = paged_layer(layer(FlashAttentionImpl("fp8")), kv_cache(torch.uint8))
    assert fp8.key_cache.dtype == torch.float8_e4m3fn and fp8.k_scale is not None


def test_on_the_cpu_every_layer_keeps_the_backends_own_write(rotation, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")  # Triton runs on CPU tensors only in it
    choice = choose_fused_layers(
        {"l0": layer(), "l1": layer()},
        {"l0": kv_cache(torch.float32), "l1": kv_cache(torch.float32)},
        {"l0": rotation, "l1": None},
        torch.float32,
        backend_write(),
        {},
        {},
    )
    assert choice.layers == {}
    assert set(choice.reasons) == {"l0", "l1"}
    assert "CPU backend's own cache write" in choice.summary()
    assert "on all 2 layer(s)" in FusedLoadChoice({"a": 1, "b": 2}).summary()


def test_the_workers_fused_branch_writes_what_its_layer_by_layer_branch_writes(
    rotation,
):
    """ChunkCacheWorker._load_rows, both branches on the same step: the fused
    kernel with the per-stretch cos/sin table and each row's stretch index,
    against gather + rotation + the backend's write (reshape_and_cache_flash's
    arithmetic), on a RoPE layer and a layer without RoPE; two requests, three
    stretches, deltas of both signs."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
        LoadRows,
        RequestLoad,
        SegmentStretch,
    )
    from vllm.v1.worker.fused_chunk_load import PagedLayer
    from vllm.v1.worker.position_remapper import PositionRemapper, RemapRows

    from tests.unit.distributed.test_chunk_cache_worker import _worker

    gen = torch.Generator().manual_seed(5)
    loads = [
        RequestLoad(
            block_ids=(2, 3),
            stretches=(
                SegmentStretch(
                    (4, 5), first_row=3, num_rows=9, dst_position=1, delta=700
                ),
                SegmentStretch(
                    (6,), first_row=0, num_rows=7, dst_position=12, delta=-2
                ),
            ),
        ),
        RequestLoad(
            block_ids=(5,),
            stretches=(
                SegmentStretch(
                    (1, 2), first_row=0, num_rows=11, dst_position=0, delta=40000
                ),
            ),
        ),
    ]
    expanded = LoadRows.expand(loads, 16, BLOCK, torch.device("cpu"))
    rows = RemapRows(
        expanded.src_rows,
        expanded.dst_slots,
        expanded.deltas,
        expanded.stretch_index,
        expanded.stretch_deltas,
    )
    pools = {
        name: (
            torch.randn(7 * 16, HEADS, HEAD, generator=gen).bfloat16(),
            torch.randn(7 * 16, HEADS, HEAD, generator=gen).bfloat16(),
        )
        for name in ("rope", "plain")
    }
    written = {}
    for fused in (False, True):
        caches = {name: kv_cache(torch.bfloat16).zero_() for name in pools}
        worker = _worker()
        worker.device = torch.device("cpu")
        worker.pool_key = {name: k for name, (k, _) in pools.items()}
        worker.pool_value = {name: v for name, (_, v) in pools.items()}
        worker._rotations = {id(rotation): rotation}

        def write(name, key, value, slots, caches=caches):
            write_kv(caches[name], key, value, slots)

        worker.remappers = {
            "rope": PositionRemapper(rotation, write),
            "plain": PositionRemapper(None, write),
        }
        worker._fused = FusedLoadChoice(
            {name: PagedLayer(*cache.unbind(1)) for name, cache in caches.items()}
            if fused
            else {}
        )
        worker._fused_groups = group_fused_layers(
            worker._fused,
            worker.pool_key,
            worker.pool_value,
            {name: remapper.rotation for name, remapper in worker.remappers.items()},
        )
        assert len(worker._fused_groups) == (2 if fused else 0)  # RoPE and no RoPE
        worker._load_rows(rows)
        written[fused] = caches
    for name in pools:
        assert written[False][name].any(), name
        assert torch.equal(
            written[True][name].view(torch.int16),
            written[False][name].view(torch.int16),
        ), name


def test_fused_layers_share_one_launch_per_rope_and_shape(rotation):
    from vllm.v1.worker.fused_chunk_load import PagedLayer

    names = ["l0", "l1", "l2", "plain", "wide"]
    pools = {
        n: torch.zeros(32, HEADS, 2 * HEAD if n == "wide" else HEAD) for n in names
    }
    caches = {
        n: kv_cache(torch.float32)
        if n != "wide"
        else torch.zeros(BLOCKS, 2, BLOCK, HEADS, 2 * HEAD)
        for n in names
    }
    choice = FusedLoadChoice({n: PagedLayer(*caches[n].unbind(1)) for n in names})
    rotations = {n: (None if n == "plain" else rotation) for n in names}
    launches = group_fused_layers(choice, pools, pools, rotations)
    assert sorted(launch.names for launch in launches) == [
        ("l0", "l1", "l2"),
        ("plain",),
        ("wide",),
    ]
    assert {launch.names: launch.rotation for launch in launches}[("plain",)] is None


def test_the_workers_fused_capture_copies_what_its_reader_branch_copies(rotation):
    """ChunkCacheWorker.capture_after_forward, both branches on the same step (two
    children, one mid-prefill): one fused copy launch per group against the backend's
    reader layer by layer (`_read_flash`), on the RoPE and the no-RoPE launch."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        CacheWriter,
        _read_flash,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.capture_path import (
        CaptureChoice,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
        ChildStore,
        ChunkCacheMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.worker import (
        ChunkCacheWorker,
    )
    from vllm.v1.worker.fused_chunk_load import PagedLayer

    from tests.unit.distributed.test_chunk_cache_worker import _worker

    gen = torch.Generator().manual_seed(9)
    caches = {
        name: kv_cache(torch.bfloat16).normal_(generator=gen)
        for name in ("rope", "plain")
    }
    meta = ChunkCacheMetadata(
        stores=[
            ChildStore(
                block_ids=(2, 4),
                pool_block_ids=(3, 1),
                first_position=5,
                end_position=21,
                store_start=1,
            ),
            ChildStore(
                block_ids=(5,),
                pool_block_ids=(6,),
                first_position=0,
                end_position=9,
                store_start=0,
            ),
        ]
    )
    pools = {}
    for fused in (False, True):
        worker = _worker()
        worker.device = torch.device("cpu")
        worker.latent = {}
        worker.pool_key = {
            n: torch.zeros(7 * 16, HEADS, HEAD, dtype=torch.bfloat16) for n in caches
        }
        worker.pool_value = {
            n: torch.zeros(7 * 16, HEADS, HEAD, dtype=torch.bfloat16) for n in caches
        }
        worker._layers = {n: SimpleNamespace() for n in caches}
        worker._kv_caches = caches
        worker._capture = CaptureChoice(
            after_forward={
                n: CacheWriter("FLASH_ATTN", None, _read_flash) for n in caches
            }
        )
        choice = FusedLoadChoice(
            {n: PagedLayer(*c.unbind(1)) for n, c in caches.items()}
        )
        worker._capture_groups = (
            group_fused_layers(
                choice,
                worker.pool_key,
                worker.pool_value,
                {"rope": rotation, "plain": None},
            )
            if fused
            else []
        )
        assert len(worker._capture_groups) == (2 if fused else 0)
        ChunkCacheWorker.capture_after_forward(worker, meta)
        pools[fused] = worker
    for n in caches:
        assert pools[False].pool_key[n].any()
        for part in ("pool_key", "pool_value"):
            assert torch.equal(
                getattr(pools[True], part)[n].view(torch.int16),
                getattr(pools[False], part)[n].view(torch.int16),
            ), (n, part)
