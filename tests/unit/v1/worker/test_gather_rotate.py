# SPDX-License-Identifier: Apache-2.0
"""The one-pass CPU load of K (gather_rotate.c) against the passes it replaces.

Oracle: torch's `index_select` and casts with vLLM's own CPU RoPE op
(`torch.ops._C.rotary_embedding`), and the generic `RopeRotation.rotate` (torch
elementwise ops with the rounding the op's self-check chose): bytes equal, not
within a tolerance. Neither shares code with the C kernel.
"""

import os
from pathlib import Path

import pytest
import torch
from tests.unit.v1.worker.test_position_remapper import CASES, NUM_HEADS, make_rope

from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.v1.worker import gather_rotate
from vllm.v1.worker.gather_rotate import BuildError, GatherRotate
from vllm.v1.worker.position_remapper import (
    PositionRemapper,
    RemapRows,
    RemapScratch,
    RopeRotation,
)

CPU = torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> GatherRotate:
    # NOTE: a build that fails here fails the tests (CI has a C compiler);
    # the engine instead keeps the passes and logs why (worker.py).
    return GatherRotate.load(tmp_path_factory.mktemp("gather_rotate"))


def _sample(rotation: RopeRotation, dtype, rows=300, pool_rows=512, heads=NUM_HEADS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = (4 * torch.randn(pool_rows, heads, rotation.head_size, generator=gen)).to(dtype)
    src = torch.randint(0, pool_rows, (rows,), generator=gen)
    deltas = torch.tensor([0, 5, -129, 3000, -40000, 99991])
    index = torch.randint(0, deltas.shape[0], (rows,), generator=gen)
    return pool, src, deltas, index


def _by_op(rotation, pool, src, index, table):
    """The remapper's passes: gather, fp32, vLLM's RoPE op in place, cast back."""
    rows = pool.index_select(0, src).float()
    rotation.rotate_in_place_indexed(rows, index, table)
    return rows.to(pool.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, params, neox", CASES,
                         ids=[f"{c[0]}-{'neox' if c[2] else 'gptj'}" for c in CASES])
def test_one_pass_equals_the_passes_byte_for_byte(vllm_config_context, kernel, name, params,
                                                  neox, dtype):
    rotation = RopeRotation(make_rope(params, neox))
    pool, src, deltas, index = _sample(rotation, dtype)
    table = rotation.stretch_cos_sin(deltas, CPU).op_table()
    got = torch.empty(src.shape[0], NUM_HEADS, rotation.head_size, dtype=dtype)
    kernel(pool, src, index, table, rotation, got)
    # The generic rotation (torch ops) with the rounding the op's check chose
    # (the kernel's call settled it).
    generic = rotation.rotate(pool[src], deltas[index])
    assert torch.equal(got.view(torch.uint8), generic.view(torch.uint8))
    if rotation.rotates_in_place(CPU):
        assert torch.equal(got.view(torch.uint8),
                           _by_op(rotation, pool, src, index, table).view(torch.uint8))
        assert kernel.serves(rotation, pool), kernel.why_not(rotation, pool)


@pytest.mark.parametrize("head_size, rotary_dim", [(80, 80), (128, 128), (96, 32)])
def test_other_head_sizes(vllm_config_context, kernel, head_size, rotary_dim):
    """Half widths the kernel does not specialise (40, 16 of 96) and one it does
    (64): the same bytes as the generic rotation."""
    rope = get_rope(head_size, 4096, True,
                    {"rope_type": "default", "partial_rotary_factor": rotary_dim / head_size},
                    torch.float32)
    rotation = RopeRotation(rope)
    assert rotation.rotary_dim == rotary_dim
    rotation.rotates_in_place(CPU)
    pool, src, deltas, index = _sample(rotation, torch.bfloat16, heads=3)
    table = rotation.stretch_cos_sin(deltas, CPU).op_table()
    got = torch.empty(src.shape[0], 3, head_size, dtype=torch.bfloat16)
    kernel(pool, src, index, table, rotation, got)
    assert torch.equal(got.view(torch.int16),
                       rotation.rotate(pool[src], deltas[index]).view(torch.int16))


def test_threads_split_rows_without_changing_a_byte(vllm_config_context, kernel):
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    rotation.rotates_in_place(CPU)
    pool, src, deltas, index = _sample(rotation, torch.bfloat16, rows=20_000, pool_rows=30_000)
    table = rotation.stretch_cos_sin(deltas, CPU).op_table()
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty(src.shape[0], NUM_HEADS, rotation.head_size, dtype=torch.bfloat16)
            kernel(pool, src, index, table, rotation, out)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert torch.equal(outs[0].view(torch.int16),
                       rotation.rotate(pool[src], deltas[index]).view(torch.int16))


def test_an_index_out_of_range_is_an_error_not_a_read(vllm_config_context, kernel):
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    pool, src, deltas, index = _sample(rotation, torch.bfloat16, rows=10, pool_rows=16)
    table = rotation.stretch_cos_sin(deltas, CPU).op_table()
    out = torch.full((10, NUM_HEADS, rotation.head_size), 7.0, dtype=torch.bfloat16)
    for bad_src, bad_index, text in ((16, 0, "pool row 16 of 16"), (-1, 0, "pool row -1"),
                                     (0, 6, "table entry 6 of 6")):
        s, i = src.clone(), index.clone()
        s[4], i[4] = bad_src, bad_index
        with pytest.raises(IndexError, match=f"row 4 reads .*{text}"):
            kernel(pool, s, i, table, rotation, out)
    # Checked before anything is written.
    assert bool((out == 7.0).all())
    with pytest.raises(ValueError, match="one row shape"):
        kernel(pool, src, index, table, rotation, out[:, :1])


def test_remapper_with_the_kernel_writes_what_the_passes_write(vllm_config_context, kernel):
    """Through `PositionRemapper.remap_layer` with the step's stretch table, in
    pieces through one scratch, as the worker loads: the written K and V equal
    the remapper's without the kernel (gather, casts, vLLM's op), byte for byte."""
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    pool_k = (4 * torch.randn(400, NUM_HEADS, rotation.head_size)).to(torch.bfloat16)
    pool_v = torch.randn(400, NUM_HEADS, rotation.head_size).to(torch.bfloat16)
    if not kernel.serves(rotation, pool_k):
        pytest.fail(f"the kernel is refused for the default rope: {kernel.why_not(rotation, pool_k)}")
    stretch_deltas = torch.tensor([17, -5, 2048])
    stretch_index = torch.arange(240) // 80
    rows = RemapRows(src_rows=torch.randperm(400)[:240], dst_slots=torch.randperm(300)[:240],
                     deltas=stretch_deltas[stretch_index], stretch_index=stretch_index,
                     stretch_deltas=stretch_deltas)
    stretches = rotation.stretch_cos_sin(stretch_deltas, CPU)
    caches = {}
    for label, one_pass in (("kernel", kernel), ("passes", None)):
        cache_k = torch.zeros(300, NUM_HEADS, rotation.head_size, dtype=torch.bfloat16)
        cache_v = torch.zeros_like(cache_k)

        def write_rows(name, key, value, slots, cache_k=cache_k, cache_v=cache_v):
            cache_k[slots] = key
            cache_v[slots] = value

        remapper = PositionRemapper(rotation, write_rows, RemapScratch(64), one_pass)
        for piece in rows.pieces(64):
            remapper.remap_layer("l", pool_k, pool_v, piece, stretches)
        caches[label] = (cache_k, cache_v)
    for got, expected in zip(caches["kernel"], caches["passes"]):
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_refusals_name_their_reason(vllm_config_context, kernel, tmp_path):
    rope = make_rope({"rope_type": "default"}, True)
    pool = torch.zeros(8, NUM_HEADS, 64, dtype=torch.bfloat16)
    generic = RopeRotation(rope, use_cpu_kernel=False)
    assert kernel.why_not(generic, pool) == "not vLLM's CPU RoPE op path"
    rotation = RopeRotation(rope)
    if rotation.rotates_in_place(CPU):
        assert "no kernel for torch.int8" == kernel.why_not(rotation, pool.to(torch.int8))
    with pytest.raises(BuildError, match="no C compiler"):
        gather_rotate.build(tmp_path, compiler="no-such-cc")


def test_build_is_cached_by_content(tmp_path, kernel):
    first = gather_rotate.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert gather_rotate.build(tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    assert os.access(first, os.R_OK) and isinstance(first, Path)
