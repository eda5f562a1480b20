# SPDX-License-Identifier: Apache-2.0
"""The CPU backend's AMX layout of a bf16 KV cache, forced (issue 59, deliverable 6).

On a CPU with AMX tiles vLLM's CPU_ATTN picks its "amx" ISA for a bf16 cache whose block
size is a multiple of 32 (`cpu_attn._get_attn_isa`, both bases), and its cache write
(`cpu_attn_reshape_and_cache`) packs K for the tile unit. The chunk cache's capture
cannot read that layout back; its start-up self-check (capture_path.py) must see so and
keep the attention hook on those layers, with the cache restored. No machine of this
project's developers has AMX: the ISA choice is forced here by a stand-in for vLLM's one
detection, `torch.cpu._is_amx_tile_supported()`, and vLLM's real write then packs the
cache (the write's packing needs no tile instruction: it runs on any x86 CPU). The
attention kernel over such a cache uses tile instructions and is not run here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
    CacheWriter,
    _read_cpu,
    _write_cpu,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.capture_path import (
    choose_capture,
)

HEADS, HEAD = 2, 64
CPU_WRITER = CacheWriter("CPU_ATTN", _write_cpu, _read_cpu)


@pytest.fixture
def amx(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)


def _layer(block_size: int, dtype: torch.dtype):
    kv_cache = torch.zeros(6, HEADS, block_size, 2 * HEAD, dtype=dtype)
    layer = SimpleNamespace(
        kv_cache=kv_cache,
        head_size=HEAD,
        head_size_v=HEAD,
        num_kv_heads=HEADS,
        layer_name="l0",
        _k_scale_float=1.0,
        _v_scale_float=1.0,
        impl=SimpleNamespace(kv_cache_dtype="auto"),
    )
    return layer, kv_cache


@pytest.mark.parametrize("block_size", [32, 128])
def test_forced_amx_a_packed_bf16_cache_keeps_the_hook_and_is_restored(amx, block_size):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    assert _get_attn_isa(torch.bfloat16, block_size, HEAD, "auto") == "amx"
    layer, kv_cache = _layer(block_size, torch.bfloat16)
    kv_cache.normal_()
    before = kv_cache.clone()
    choice = choose_capture(
        {"l0": layer}, {"l0": kv_cache}, {"l0": CPU_WRITER}, torch.bfloat16
    )
    assert torch.equal(kv_cache, before)
    assert not choice.after_forward
    assert choice.in_attention["l0"].endswith(
        "bytes read back differ (CPU_ATTN packs this cache)"
    ), choice.in_attention


def test_forced_amx_the_write_really_packs_k_and_the_reader_does_not_know_it(
    amx, monkeypatch
):
    """VLLM's write under the forced ISA stores K elsewhere than the "vec" layout the
    reader reads (so the self-check above fails for the layout, not for the stand-in),
    and V where the reader finds it; the same rows under vec read back exactly."""
    gen = torch.Generator().manual_seed(5)
    key = torch.randn(40, HEADS, HEAD, generator=gen).to(torch.bfloat16)
    value = torch.randn(40, HEADS, HEAD, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(6 * 32, generator=gen)[:40]
    layer, kv_cache = _layer(32, torch.bfloat16)
    _write_cpu(layer, key, value, slots, None)
    got_key, _ = _read_cpu(layer, kv_cache, slots)
    assert not torch.equal(got_key, key)
    packed = kv_cache.clone()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    layer, kv_cache = _layer(32, torch.bfloat16)
    _write_cpu(layer, key, value, slots, None)
    got_key, got_value = _read_cpu(layer, kv_cache, slots)
    assert torch.equal(got_key, key) and torch.equal(got_value, value)
    assert not torch.equal(packed, kv_cache)


@pytest.mark.parametrize(
    "dtype,block_size", [(torch.float32, 32), (torch.bfloat16, 16)]
)
def test_forced_amx_other_caches_keep_a_layout_the_capture_reads(
    amx, dtype, block_size
):
    """AMX packs bf16 with blocks of a multiple of 32 only: float32 (the e2e suite's
    dtype) and a 16-row block keep the vec layouts, read back after the forward."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    assert _get_attn_isa(dtype, block_size, HEAD, "auto") != "amx"
    layer, kv_cache = _layer(block_size, dtype)
    choice = choose_capture({"l0": layer}, {"l0": kv_cache}, {"l0": CPU_WRITER}, dtype)
    assert list(choice.after_forward) == ["l0"] and not choice.in_attention
