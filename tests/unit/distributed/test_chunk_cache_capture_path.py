# SPDX-License-Identifier: Apache-2.0
"""Capture after the forward (issue 21, deliverable 2) without an engine: the backends'
readers give back the rows their writes put in, the start-up self-check picks the hook
where they do not, and the worker copies a child's rows from its paged blocks into the
pool rows the scheduler named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
    CacheWriter,
    _read_cpu,
    _read_flash,
    _write_cpu,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.capture_path import (
    choose_capture,
)
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

from tests.unit.vllm_triton_cache_write import write_kv

HEADS, HEAD = 2, 64


def _cpu_layer(block_size: int, dtype: torch.dtype, cache_dtype: str = "auto"):
    kv_cache = torch.zeros(6, HEADS, block_size, 2 * HEAD, dtype=dtype)
    layer = SimpleNamespace(
        kv_cache=kv_cache,
        head_size=HEAD,
        head_size_v=HEAD,
        num_kv_heads=HEADS,
        layer_name="l0",
        _k_scale_float=1.0,
        _v_scale_float=1.0,
        impl=SimpleNamespace(kv_cache_dtype=cache_dtype),
    )
    return layer, kv_cache


CPU_WRITER = CacheWriter("CPU_ATTN", _write_cpu, _read_cpu)


def _flash_writer():
    # The write: vLLM's own Triton reshape_and_cache_flash (Triton's interpreter), not
    # the reader's index expression.
    def write(layer, key, value, slots, forward_context):
        write_kv(layer.kv_cache, key, value, slots)

    return CacheWriter("FLASH_ATTN", write, _read_flash)


def _flash_layer(layout: str, dtype: torch.dtype):
    # [blocks, 2, block_size, heads, head]; HND keeps heads outside the block's tokens.
    if layout == "NHD":
        kv_cache = torch.zeros(6, 2, 16, HEADS, HEAD, dtype=dtype)
    else:
        kv_cache = torch.zeros(6, 2, HEADS, 16, HEAD, dtype=dtype).transpose(2, 3)
    layer = SimpleNamespace(
        kv_cache=kv_cache,
        head_size=HEAD,
        head_size_v=HEAD,
        num_kv_heads=HEADS,
        impl=SimpleNamespace(kv_cache_dtype="auto"),
    )
    return layer, kv_cache


@pytest.mark.parametrize("block_size", [16, 32, 128])  # the "vec16" and "vec" layouts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_reader_returns_what_the_cpu_backend_wrote(block_size, dtype):
    """Through vLLM's own `cpu_attn_reshape_and_cache` (the ISA it picks for these
    shapes), read back at the slots, bit for bit."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    layer, kv_cache = _cpu_layer(block_size, dtype)
    if _get_attn_isa(dtype, block_size, HEAD, "auto") not in ("vec", "vec16"):
        # NOTE: an AMX machine packs bf16 K for its tile unit: the reader does
        # not know that layout, and the self-check must say so (next test).
        assert choose_capture(
            {"l0": layer}, {"l0": kv_cache}, {"l0": CPU_WRITER}, dtype
        ).in_attention
        return
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(40, HEADS, HEAD, generator=gen).to(dtype)
    value = torch.randn(40, HEADS, HEAD, generator=gen).to(dtype)
    slots = torch.randperm(6 * block_size, generator=gen)[:40]
    _write_cpu(layer, key, value, slots, None)
    got_key, got_value = _read_cpu(layer, kv_cache, slots)
    assert torch.equal(got_key, key) and torch.equal(got_value, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_check_takes_the_reader_where_it_reads_back_and_restores_the_cache(dtype):
    layer, kv_cache = _cpu_layer(32, dtype)
    kv_cache.normal_()
    before = kv_cache.clone()
    choice = choose_capture({"l0": layer}, {"l0": kv_cache}, {"l0": CPU_WRITER}, dtype)
    assert torch.equal(kv_cache, before)
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    # Whichever the machine's layout, the choice is the one its bytes allow.
    readable = _get_attn_isa(dtype, 32, HEAD, "auto") in ("vec", "vec16")
    assert list(choice.after_forward) == (["l0"] if readable else [])
    assert list(choice.in_attention) == ([] if readable else ["l0"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flash_reader_returns_what_vllms_flash_write_put_in(layout, dtype):
    """Rows written by vLLM's own `triton_reshape_and_cache_flash` (the Triton twin of
    the CUDA backends' write, run by Triton's interpreter) into FlashAttention's NHD and
    FlashInfer's HND strides, read back by `_read_flash` bit for bit; the self-check
    then takes the capture after the forward. Issue 30: before, the "write" was the
    reader's own index expression."""
    layer, kv_cache = _flash_layer(layout, dtype)
    gen = torch.Generator().manual_seed(11)
    key = (3 * torch.randn(37, HEADS, HEAD, generator=gen)).to(dtype)
    value = (3 * torch.randn(37, HEADS, HEAD, generator=gen)).to(dtype)
    slots = torch.randperm(6 * 16, generator=gen)[:37]
    write_kv(kv_cache, key, value, slots)
    assert kv_cache.count_nonzero() > 0
    got_key, got_value = _read_flash(layer, kv_cache, slots)
    assert torch.equal(got_key.view(torch.uint8), key.view(torch.uint8))
    assert torch.equal(got_value.view(torch.uint8), value.view(torch.uint8))
    choice = choose_capture(
        {"l0": layer}, {"l0": kv_cache}, {"l0": _flash_writer()}, dtype
    )
    assert list(choice.after_forward) == ["l0"], choice.in_attention


def test_self_check_keeps_the_hook_and_says_why():
    dtype = torch.float32
    layer, kv_cache = _cpu_layer(32, dtype)

    # A reader that gets one layout detail wrong (K read row-major).
    def transposed(layer, kv_cache, slots):
        key, value = _read_cpu(layer, kv_cache, slots)
        return key.flip(-1), value

    cases = {
        "wrong": (layer, kv_cache, CacheWriter("CPU_ATTN", _write_cpu, transposed)),
        "no reader": (layer, kv_cache, CacheWriter("X", _write_cpu, None)),
        "fp8": (_cpu_layer(32, dtype, "fp8")[0], None, CPU_WRITER),
        "unbound": (_cpu_layer(32, dtype)[0], kv_cache, CPU_WRITER),
    }
    layers = {name: c[0] for name, c in cases.items()}
    caches = {
        name: (c[1] if c[1] is not None else c[0].kv_cache) for name, c in cases.items()
    }
    choice = choose_capture(layers, caches, {n: c[2] for n, c in cases.items()}, dtype)
    assert not choice.after_forward
    why = choice.in_attention
    assert "bytes read back differ" in why["wrong"]
    assert why["no reader"] == "X's cache has no reader"
    assert why["fp8"].startswith("quantized KV cache (fp8)")
    assert why["unbound"] == "the layer's bound cache is not the registered one"
    assert "in the attention hook on 4 layer(s)" in choice.summary()


def test_capture_after_forward_copies_the_childs_rows_into_its_pool_rows():
    """A child in blocks (3, 1) of 16 slots computed positions 4..19 in this step and
    stores from position 1 (after a one-token sink): rows 3..18 of its entry, pool
    blocks (7, 2). Exactly those pool rows change, to exactly the child's K/V, which
    vLLM's own Triton cache write put at the child's slots (not the reader's index
    expression)."""
    dtype = torch.bfloat16
    layer, kv_cache = _flash_layer("HND", dtype)
    kv_cache.normal_()
    gen = torch.Generator().manual_seed(5)
    child_key = torch.randn(16, HEADS, HEAD, generator=gen).to(dtype)
    child_value = torch.randn(16, HEADS, HEAD, generator=gen).to(dtype)
    positions = torch.arange(4, 20)
    child_slots = torch.tensor([3, 1])[positions // 16] * 16 + positions % 16
    write_kv(kv_cache, child_key, child_value, child_slots)
    choice = choose_capture(
        {"l0": layer}, {"l0": kv_cache}, {"l0": _flash_writer()}, dtype
    )
    rows = 12 * POOL_BLOCK_SIZE
    worker = SimpleNamespace(
        _capture=choice,
        _capture_groups=[],
        latent={},
        device=torch.device("cpu"),
        block_size=16,
        _layers={"l0": layer},
        _kv_caches={"l0": kv_cache},
        pool_key={"l0": torch.zeros(rows, HEADS, HEAD, dtype=dtype)},
        pool_value={"l0": torch.zeros(rows, HEADS, HEAD, dtype=dtype)},
        pool_resident=True,
    )
    store = ChildStore(
        block_ids=(3, 1),
        pool_block_ids=(7, 2),
        first_position=4,
        end_position=20,
        store_start=1,
    )
    ChunkCacheWorker.capture_after_forward(worker, ChunkCacheMetadata(stores=[store]))
    entry_rows = positions - 1
    pool_rows = (
        torch.tensor([7, 2])[entry_rows // POOL_BLOCK_SIZE] * POOL_BLOCK_SIZE
        + entry_rows % POOL_BLOCK_SIZE
    )
    assert torch.equal(worker.pool_key["l0"][pool_rows], child_key)
    assert torch.equal(worker.pool_value["l0"][pool_rows], child_value)
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[pool_rows] = False
    assert not worker.pool_key["l0"][untouched].any()
    assert not worker.pool_value["l0"][untouched].any()
