# SPDX-License-Identifier: Apache-2.0
"""The fused load kernel (Triton, run by its interpreter on the CPU) writes exactly what
today's path writes: gather, `RopeRotation.rotate` (rounded products, fp32), cast to the
pool's dtype, then the backend's cache write. The backend's write is vLLM's own: its
Triton `triton_reshape_and_cache_flash` under the interpreter on the CPU
(tests/unit/vllm_triton_cache_write.py), and on a GPU the CUDA op
`reshape_and_cache_flash` for the fp8 cases (`float(x) / scale`, saturated, rounded to
e4m3), for which the interpreter is no oracle: GPU-only, not executed here. Bit for bit,
for the NHD (FlashAttention, Triton) and HND (FlashInfer) layouts, neox and GPT-J,
partial rotary, YaRN, fp32/bf16/fp16 pools, a layer without RoPE, and (GPU) fp8 with one
scale or one per head.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton compiles anything

import pytest
import torch
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.v1.worker.position_remapper import RopeRotation

from tests.unit.vllm_triton_cache_write import write_rows

fused = pytest.importorskip("vllm.v1.worker.fused_chunk_load")
if not fused.available():
    pytest.fail(
        "Triton is part of vLLM's CPU install: the fused load must be importable"
    )

NUM_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS, POOL_ROWS = 2, 32, 16, 8, 64
GPU_ONLY = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="GPU-only: the fp8 oracle is vLLM's CUDA reshape_and_cache_flash (Triton's "
    "interpreter does not round to fp8 as the GPU does)",
)


# Launch geometries each kernel is checked under: its default (the best of the
# H100 sweep of 2026-11-26: load 4 rows x 2 heads, capture 8 rows x 1 head, both 2
# warps), the one-row former default (Triton's warps), and 32 rows x 4 heads (of 2)
# x 2 warps: the sweep's largest row tile, heads past the layer's masked. The row
# counts below (37) are no multiple of the tiles: the last tile's rows are masked.
# Three a kernel, as before: CI time stays flat.
_OTHERS = [
    fused.ONE_ROW_GEOMETRY,
    fused.LaunchGeometry(32, heads_per_program=4, num_warps=2),
]
LOAD_GEOMETRIES = [fused.DEFAULT_LOAD_GEOMETRY] + _OTHERS
CAPTURE_GEOMETRIES = [fused.DEFAULT_CAPTURE_GEOMETRY] + _OTHERS
GEOMETRY_IDS = ["default", "one-row", "rows32-heads4-warps2"]


def paged(
    layout: str, dtype: torch.dtype, device="cpu", seed: int | None = None
) -> torch.Tensor:
    """A cache viewed as [blocks, block_size, heads, head] in `layout`: zeroed, or
    with `seed`, random bytes (so that a stray write of anything shows)."""
    shape = (
        (NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
        if layout == "NHD"
        else (NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE)
    )
    cache = torch.zeros(shape, dtype=dtype)
    if seed is not None:
        raw = cache.view(torch.uint8)
        raw.copy_(
            torch.randint(
                0,
                256,
                raw.shape,
                dtype=torch.uint8,
                generator=torch.Generator().manual_seed(seed),
            )
        )
    cache = cache.to(device)
    return cache if layout == "NHD" else cache.transpose(1, 2)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
CASES = [  # (layout, pool dtype, cache, rope params or None, neox, per-head scales)
    ("NHD", torch.float32, "auto", {"rope_type": "default"}, True, False),
    ("NHD", torch.float32, "auto", {"rope_type": "default"}, False, False),
    ("HND", torch.bfloat16, "auto", {"rope_type": "default"}, True, False),
    (
        "NHD",
        torch.bfloat16,
        "auto",
        {"rope_type": "default", "partial_rotary_factor": 0.5},
        False,
        False,
    ),
    ("NHD", torch.bfloat16, "auto", YARN, True, False),
    ("HND", torch.float16, "auto", {"rope_type": "default"}, False, False),
    ("HND", torch.bfloat16, "auto", None, True, False),
    pytest.param("NHD", torch.bfloat16, "fp8", YARN, True, False, marks=GPU_ONLY),
    pytest.param(
        "HND",
        torch.float16,
        "fp8",
        {"rope_type": "default"},
        False,
        True,
        marks=GPU_ONLY,
    ),
]


def _case_id(c):
    c = c.values if hasattr(c, "values") else c
    return (
        f"{c[0]}-{str(c[1])[6:]}-{c[2]}-{'rope' if c[3] else 'norope'}-"
        f"{'neox' if c[4] else 'gptj'}{'-perhead' if c[5] else ''}"
    )


def _backend_write(key_cache, value_cache, key, value, slots, k_scale, v_scale, fp8):
    if not fp8:
        write_rows(key_cache, value_cache, key, value, slots)
        return
    from vllm import _custom_ops as ops  # the CUDA build's op (GPU-only cases)

    ops.reshape_and_cache_flash(
        key, value, key_cache, value_cache, slots, "fp8", k_scale, v_scale
    )


@pytest.mark.parametrize("geometry", LOAD_GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize(
    "layout, dtype, cache, params, neox, per_head",
    CASES,
    ids=[_case_id(c) for c in CASES],
)
def test_fused_load_writes_what_todays_path_writes_bit_for_bit(
    vllm_config_context, layout, dtype, cache, params, neox, per_head, geometry
):
    fp8 = cache == "fp8"
    device = torch.device("cuda" if fp8 else "cpu")
    gen = torch.Generator().manual_seed(3)
    pool_key = (3 * torch.randn(POOL_ROWS, NUM_HEADS, HEAD_SIZE, generator=gen)).to(
        dtype
    )
    pool_value = (3 * torch.randn(POOL_ROWS, NUM_HEADS, HEAD_SIZE, generator=gen)).to(
        dtype
    )
    n = 37  # no multiple of a geometry's tile
    src_rows = torch.randperm(POOL_ROWS, generator=gen)[:n]
    dst_slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:n]
    deltas = torch.tensor([0, 5, -300, 2900]).repeat_interleave(
        torch.tensor([10, 10, 10, 7])
    )
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    k_scale = torch.tensor([0.02, 0.05]) if per_head else torch.tensor([0.03])
    v_scale = k_scale * 0.5
    pool_key, pool_value, src_rows, dst_slots, deltas, k_scale, v_scale = (
        t.to(device)
        for t in (pool_key, pool_value, src_rows, dst_slots, deltas, k_scale, v_scale)
    )

    # Today's path: gather, rotate, cast, the backend's own write.
    key = pool_key[src_rows]
    rotation = None
    if params is not None:
        rope = get_rope(HEAD_SIZE, 4096, neox, dict(params), torch.float32).to(device)
        rotation = RopeRotation(rope, use_cpu_kernel=False)
        key = rotation.rotate(key.float(), deltas).to(dtype)
    # Both start from the same random bytes: the slots not given must keep them.
    want_k, want_v = (paged(layout, cache_dtype, device, seed) for seed in (11, 12))
    _backend_write(
        want_k, want_v, key, pool_value[src_rows], dst_slots, k_scale, v_scale, fp8
    )

    # The fused kernel, with the step's per-distinct-delta table.
    got_k, got_v = (paged(layout, cache_dtype, device, seed) for seed in (11, 12))
    delta_index = table = None
    if rotation is not None:
        distinct, delta_index = torch.unique(deltas, return_inverse=True)
        # NOTE: cos_sin forms the table on the host; the kernel reads it where it runs.
        table = tuple(t.to(device) for t in rotation.cos_sin(distinct))
    layer = fused.PagedLayer(
        got_k, got_v, k_scale if fp8 else None, v_scale if fp8 else None
    )
    fused.fused_load(
        fused.FusedGroup.of([pool_key], [pool_value], [layer]),
        src_rows,
        dst_slots,
        delta_index,
        table,
        neox,
        rotation.rotary_dim if rotation else HEAD_SIZE,
        geometry=geometry,
    )

    def slots_bits(t):  # [slot, heads * head bytes], whatever the layout
        return (
            t.contiguous().cpu().view(torch.uint8).reshape(NUM_BLOCKS * BLOCK_SIZE, -1)
        )

    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[dst_slots.cpu()] = True
    for got, want, seed in ((got_v, want_v, 12), (got_k, want_k, 11)):
        assert torch.equal(slots_bits(got), slots_bits(want))
        # Every slot given was written (all heads), no other slot changed.
        initial = slots_bits(paged(layout, cache_dtype, "cpu", seed))
        changed = slots_bits(got)[written] != initial[written]
        assert changed.reshape(n, NUM_HEADS, -1).any(dim=2).all()
        assert torch.equal(slots_bits(got)[~written], initial[~written])


def _conversion_inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = e4m3[torch.isfinite(e4m3)]
    ties = (grid[:-1] + grid[1:]) / 2  # halfway between neighbours (sorted below)
    spread = torch.cat(
        [torch.randn(20000, generator=gen) * s for s in (1e-4, 1e-2, 1, 50, 300)]
    )
    values = torch.cat(
        [grid, ties.sort().values, spread, -spread, torch.tensor([0.0, -0.0])]
    )
    return values.clamp(-448.0, 448.0).contiguous()


def test_kernel_roundings_equal_torchs_round_to_nearest_even():
    """The kernel's own fp32 -> bf16 and fp32 -> fp8 e4m3 roundings (integer and
    magic-number arithmetic, so Triton's interpreter and a GPU agree) against torch's
    casts, on e4m3's whole grid, every tie between neighbours, subnormals, +-0."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(x_ptr, bf16_ptr, e4m3_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        x = tl.load(x_ptr + i, mask=mask)
        tl.store(bf16_ptr + i, fused._round_to_bf16(x), mask=mask)
        tl.store(
            e4m3_ptr + i, fused._round_to_e4m3_grid(x).to(tl.float8e4nv), mask=mask
        )

    x = _conversion_inputs()
    # Ties of e4m3's grid split fp32 values exactly: the test does meet ties.
    assert x.numel() > 100000
    bf16 = torch.empty(x.shape, dtype=torch.bfloat16)
    e4m3 = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    convert[(triton.cdiv(x.numel(), 1024),)](x, bf16, e4m3, x.numel(), BLOCK=1024)
    assert torch.equal(bf16.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(
        e4m3.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8)
    )


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-perhead"])
def test_one_launch_loads_every_layer_of_a_group_as_one_launch_per_layer(
    vllm_config_context, fp8
):
    """All layers of a step in one launch (pointer tables, a tiled geometry): the bytes
    of a launch per layer (default geometry)."""
    gen = torch.Generator().manual_seed(6)
    rope = get_rope(HEAD_SIZE, 4096, True, {"rope_type": "default"}, torch.float32)
    rotation = RopeRotation(rope, use_cpu_kernel=False)
    layers = 3
    pools_k = [
        (3 * torch.randn(POOL_ROWS, NUM_HEADS, HEAD_SIZE, generator=gen)).bfloat16()
        for _ in range(layers)
    ]
    pools_v = [
        (3 * torch.randn(POOL_ROWS, NUM_HEADS, HEAD_SIZE, generator=gen)).bfloat16()
        for _ in range(layers)
    ]
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    scales = [
        (torch.rand(NUM_HEADS, generator=gen) / 10 + 0.01) for _ in range(2 * layers)
    ]
    src_rows = torch.randperm(POOL_ROWS, generator=gen)[:30]
    dst_slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:30]
    stretch_index = torch.tensor([0] * 10 + [1] * 12 + [2] * 8)
    table = rotation.cos_sin(torch.tensor([4, -900, 31000]))

    def paged_layers():
        return [
            fused.PagedLayer(
                paged("HND", cache_dtype),
                paged("HND", cache_dtype),
                scales[2 * i] if fp8 else None,
                scales[2 * i + 1] if fp8 else None,
            )
            for i in range(layers)
        ]

    one_by_one, together = paged_layers(), paged_layers()
    for k, v, layer in zip(pools_k, pools_v, one_by_one):
        fused.fused_load(
            fused.FusedGroup.of([k], [v], [layer]),
            src_rows,
            dst_slots,
            stretch_index,
            table,
            True,
            HEAD_SIZE,
        )
    group = fused.FusedGroup.of(pools_k, pools_v, together)
    assert group.num_layers == 3
    # NOTE: tiled (8 rows x 2 heads, 30 rows: a partial tile), so that the per-head
    # scales are also read as a tile's vector; the oracle stays the default launches.
    fused.fused_load(
        group,
        src_rows,
        dst_slots,
        stretch_index,
        table,
        True,
        HEAD_SIZE,
        geometry=fused.LaunchGeometry(8, heads_per_program=2),
    )
    for a, b in zip(one_by_one, together):
        for x, y in ((a.key_cache, b.key_cache), (a.value_cache, b.value_cache)):
            assert x.view(torch.uint8).any()
            assert torch.equal(
                x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
            )


def test_a_group_refuses_layers_that_differ():
    k = torch.zeros(POOL_ROWS, NUM_HEADS, HEAD_SIZE)
    layer = fused.PagedLayer(paged("NHD", torch.float32), paged("NHD", torch.float32))
    with pytest.raises(ValueError, match="pools must share"):
        fused.FusedGroup.of([k, k.bfloat16()], [k, k.bfloat16()], [layer, layer])
    with pytest.raises(ValueError, match="caches must share strides"):
        fused.FusedGroup.of(
            [k, k],
            [k, k],
            [
                layer,
                fused.PagedLayer(
                    paged("HND", torch.float32), paged("HND", torch.float32)
                ),
            ],
        )
    with pytest.raises(ValueError, match="neither the pool's nor fp8"):
        fused.FusedGroup.of(
            [k],
            [k],
            [
                fused.PagedLayer(
                    paged("NHD", torch.float16), paged("NHD", torch.float16)
                )
            ],
        )
    with pytest.raises(ValueError, match="needs k_scale"):
        fused.FusedGroup.of(
            [k],
            [k],
            [
                fused.PagedLayer(
                    paged("NHD", torch.float8_e4m3fn), paged("NHD", torch.float8_e4m3fn)
                )
            ],
        )


@pytest.mark.parametrize("geometry", CAPTURE_GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_capture_copies_paged_slots_into_pool_rows_for_every_layer(
    layout, dtype, geometry
):
    """The capture after the forward (issue 21, deliverable 2): one launch copies each
    layer's rows at the child's slots into its pool rows, what the reader
    (`cache_writers._read_flash`: `cache[slot // bs, slot % bs]`) gives, bit for bit;
    no other pool row changes."""
    gen = torch.Generator().manual_seed(7)
    layers = 3
    caches = [
        fused.PagedLayer(paged(layout, dtype), paged(layout, dtype))
        for _ in range(layers)
    ]
    for layer in caches:
        layer.key_cache.copy_(3 * torch.randn(layer.key_cache.shape, generator=gen))
        layer.value_cache.copy_(3 * torch.randn(layer.value_cache.shape, generator=gen))
    # Pools start from random values: the rows not given must keep them.
    pools_k = [
        torch.randn(POOL_ROWS, NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        for _ in range(layers)
    ]
    pools_v = [
        torch.randn(POOL_ROWS, NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        for _ in range(layers)
    ]
    initial = [t.clone() for t in pools_k + pools_v]
    src_slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:37]
    dst_rows = torch.randperm(POOL_ROWS, generator=gen)[:37]  # no multiple of a tile
    fused.fused_capture(
        fused.FusedGroup.of(pools_k, pools_v, caches),
        src_slots,
        dst_rows,
        geometry=geometry,
    )
    others = torch.ones(POOL_ROWS, dtype=torch.bool)
    others[dst_rows] = False
    blocks, offsets = src_slots // BLOCK_SIZE, src_slots % BLOCK_SIZE
    for k, v, k0, v0, layer in zip(
        pools_k, pools_v, initial[:layers], initial[layers:], caches
    ):
        assert torch.equal(
            k[dst_rows].view(torch.uint8),
            layer.key_cache[blocks, offsets].contiguous().view(torch.uint8),
        )
        assert torch.equal(
            v[dst_rows].view(torch.uint8),
            layer.value_cache[blocks, offsets].contiguous().view(torch.uint8),
        )
        assert torch.equal(k[others].view(torch.uint8), k0[others].view(torch.uint8))
        assert torch.equal(v[others].view(torch.uint8), v0[others].view(torch.uint8))


def test_fused_capture_refuses_an_fp8_group():
    scale = torch.ones(1)
    fp8 = fused.PagedLayer(
        paged("NHD", torch.float8_e4m3fn),
        paged("NHD", torch.float8_e4m3fn),
        scale,
        scale,
    )
    k = torch.zeros(POOL_ROWS, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="captured in the hook"):
        fused.fused_capture(
            fused.FusedGroup.of([k], [k], [fp8]), torch.arange(2), torch.arange(2)
        )


@pytest.mark.parametrize(
    "bad", [dict(rows_per_program=3), dict(heads_per_program=0), dict(num_warps=6)]
)
def test_a_launch_geometry_takes_powers_of_two_only(bad):
    with pytest.raises(ValueError, match="power of two"):
        fused.LaunchGeometry(**bad)
    assert fused.LaunchGeometry(32, 8, 4).grid(37, 2, 3) == (2, 1, 3)
