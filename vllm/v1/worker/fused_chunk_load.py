# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused Triton kernels for a chunk-cache load and capture on a GPU.

The load does in one pass what the generic path does in about a dozen small
kernels per layer: each program reads a tile of pool rows once, rotates K by
its row's entry of the step's cos/sin table (`RopeRotation.stretch_cos_sin`)
and writes K and V into the paged cache through its strides (NHD or HND), with
the generic path's bits (docs/design/fused-load.md): products rounded then one
add, rounded to the model dtype, fp8 e4m3 as `reshape_and_cache_flash` writes
it. The capture (`fused_capture`) is the inverse copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no fused load: the caller keeps the generic path
    triton = None


@dataclass(frozen=True)
class PagedLayer:
    """A layer's paged K/V caches as the fused load writes them."""

    # [num_blocks, block_size, num_kv_heads, head_size] views (NHD), or the
    # same shape with HND strides; fp8 caches as float8_e4m3fn views.
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    # fp8 only: [1] or [num_kv_heads] fp32 scales (float(x) / scale).
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class LaunchGeometry:
    """How the kernels tile their work: each program moves `rows_per_program`
    entries times `heads_per_program` KV heads of one layer (powers of two:
    Triton block sizes), with `num_warps` warps (None: Triton's default). The
    bytes written do not depend on it (per-element arithmetic)."""

    rows_per_program: int = 1
    heads_per_program: int = 1
    num_warps: int | None = None

    def __post_init__(self):
        for name in ("rows_per_program", "heads_per_program", "num_warps"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two, got {value}")

    def grid(self, rows: int, heads: int, layers: int) -> tuple[int, int, int]:
        return (
            -(-rows // self.rows_per_program),
            -(-heads // self.heads_per_program),
            layers,
        )

    def options(self) -> dict:
        options = {"ROWS": self.rows_per_program, "HEADS": self.heads_per_program}
        if self.num_warps is not None:
            options["num_warps"] = self.num_warps
        return options


# The best geometries of the launch-geometry sweep on an H100
# (benchmarks/gpu_remap.py --sweep; docs/gpu.md); every geometry writes the
# same bytes.
DEFAULT_LOAD_GEOMETRY = LaunchGeometry(
    rows_per_program=4, heads_per_program=2, num_warps=2
)
DEFAULT_CAPTURE_GEOMETRY = LaunchGeometry(
    rows_per_program=8, heads_per_program=1, num_warps=2
)
# One row of one head: the sweep's baseline.
ONE_ROW_GEOMETRY = LaunchGeometry()


if triton is not None:

    @triton.jit
    def _round_to_bf16(x):
        # fp32 -> bf16, round to nearest even, in integer ops.
        # NOTE: Triton's interpreter truncates in `.to(tl.bfloat16)`, GPUs
        # round to nearest even: integer rounding gives the same bits on both.
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _round_to_e4m3_grid(y):
        # y in [-448, 448] (fp32) -> the nearest fp8 e4m3 value (ties to even),
        # still in fp32: adding and subtracting 2^(q + 23) rounds |y| to its
        # e4m3 quantum q. NOTE: the interpreter's own conversion does not round
        # to nearest (the GPU's does); `.to(tl.float8e4nv)` of this is exact.
        bits = y.to(tl.uint32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 127
        quantum = tl.maximum(exponent, -6) - 3  # 3 mantissa bits; subnormals below 2^-6
        magic = ((quantum + 23 + 127) << 23).to(tl.float32, bitcast=True)
        rounded = (tl.abs(y) + magic) - magic
        sign = bits & 0x80000000
        return (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _store(
        cache_ptr, offsets, x, mask, scale, MODEL: tl.constexpr, FP8: tl.constexpr
    ):
        # Round to the model's dtype first, as the rows reach the backend's
        # cache write in that dtype (MODEL: 0 fp32, 1 bf16, 2 fp16).
        x = x.to(tl.float32)
        if MODEL == 1:
            x = _round_to_bf16(x)
        elif MODEL == 2:
            x = x.to(tl.float16)
        if FP8:
            y = x.to(tl.float32) / scale
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)  # saturating (SATFINITE)
            tl.store(
                cache_ptr + offsets, _round_to_e4m3_grid(y).to(tl.float8e4nv), mask=mask
            )
        else:
            tl.store(cache_ptr + offsets, x, mask=mask)

    @triton.jit
    def _tile(num_rows, num_heads, ROWS: tl.constexpr, HEADS: tl.constexpr):
        # A program's ROWS entries x HEADS KV heads, flattened row-major (a
        # row's heads adjacent, as in the pool); and which are real.
        e = tl.arange(0, ROWS * HEADS)
        entry = tl.program_id(0) * ROWS + e // HEADS
        head = tl.program_id(1) * HEADS + e % HEADS
        return entry, head, (entry < num_rows) & (head < num_heads)

    @triton.jit
    def _layer_ptr(tables_ptr, table, num_layers, layer, DTYPE: tl.constexpr):
        # Entry `table` of the layer's addresses ([6, num_layers]: pool K, pool
        # V, key cache, value cache, k scale, v scale), as a DTYPE pointer.
        address = tl.load(tables_ptr + table * num_layers + layer)
        return address.to(tl.pointer_type(DTYPE))

    @triton.jit
    def _paged_offset(slot, head, block_size, block_stride, page_stride, head_stride):
        return (
            (slot // block_size) * block_stride
            + (slot % block_size) * page_stride
            + head * head_stride
        )[:, None]

    @triton.jit
    def _fused_load_kernel(
        tables_ptr,
        num_layers,
        num_rows,
        num_heads,
        src_rows_ptr,
        dst_slots_ptr,
        delta_index_ptr,
        cos_ptr,
        sin_ptr,
        scale_stride,
        pool_row_stride,
        pool_head_stride,
        block_stride,
        page_stride,
        head_stride,
        block_size,
        HEAD_SIZE: tl.constexpr,
        ROT_HALF: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        IS_NEOX: tl.constexpr,
        ROTATE: tl.constexpr,
        MODEL: tl.constexpr,
        FP8: tl.constexpr,
        POOL_DTYPE: tl.constexpr,
        CACHE_DTYPE: tl.constexpr,
        ROWS: tl.constexpr,
        HEADS: tl.constexpr,
    ):
        # A [ROWS * HEADS, BLOCK_D] tile of one layer (LaunchGeometry).
        entry, head, live = _tile(num_rows, num_heads, ROWS, HEADS)
        layer = tl.program_id(2)
        pool_key_ptr = _layer_ptr(tables_ptr, 0, num_layers, layer, POOL_DTYPE)
        pool_value_ptr = _layer_ptr(tables_ptr, 1, num_layers, layer, POOL_DTYPE)
        key_cache_ptr = _layer_ptr(tables_ptr, 2, num_layers, layer, CACHE_DTYPE)
        value_cache_ptr = _layer_ptr(tables_ptr, 3, num_layers, layer, CACHE_DTYPE)
        src = tl.load(src_rows_ptr + entry, mask=live, other=0)
        slot = tl.load(dst_slots_ptr + entry, mask=live, other=0)
        src_base = (src * pool_row_stride + head * pool_head_stride)[:, None]
        dst_base = _paged_offset(
            slot, head, block_size, block_stride, page_stride, head_stride
        )
        k_scale = 1.0
        v_scale = 1.0
        if FP8:
            k_scale_ptr = _layer_ptr(tables_ptr, 4, num_layers, layer, tl.float32)
            v_scale_ptr = _layer_ptr(tables_ptr, 5, num_layers, layer, tl.float32)
            scale_at = head * scale_stride
            k_scale = tl.load(k_scale_ptr + scale_at, mask=live, other=1.0)[:, None]
            v_scale = tl.load(v_scale_ptr + scale_at, mask=live, other=1.0)[:, None]

        d = tl.arange(0, BLOCK_D)[None, :]
        in_head = live[:, None] & (d < HEAD_SIZE)
        value = tl.load(pool_value_ptr + src_base + d, mask=in_head)
        _store(value_cache_ptr, dst_base + d, value, in_head, v_scale, MODEL, FP8)

        if ROTATE:
            # Values past the rotary part pass through; the pairs below.
            tail = in_head & (d >= 2 * ROT_HALF)
            key = tl.load(pool_key_ptr + src_base + d, mask=tail)
            _store(key_cache_ptr, dst_base + d, key, tail, k_scale, MODEL, FP8)
            i = tl.arange(0, BLOCK_HALF)[None, :]
            pair = live[:, None] & (i < ROT_HALF)
            first = i if IS_NEOX else 2 * i
            second = i + ROT_HALF if IS_NEOX else 2 * i + 1
            delta = tl.load(delta_index_ptr + entry, mask=live, other=0)[:, None]
            cos = tl.load(cos_ptr + delta * ROT_HALF + i, mask=pair)
            sin = tl.load(sin_ptr + delta * ROT_HALF + i, mask=pair)
            x1 = tl.load(pool_key_ptr + src_base + first, mask=pair).to(tl.float32)
            x2 = tl.load(pool_key_ptr + src_base + second, mask=pair).to(tl.float32)
            # Each product rounded (fp fusion is off at launch), then one add.
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            _store(key_cache_ptr, dst_base + first, o1, pair, k_scale, MODEL, FP8)
            _store(key_cache_ptr, dst_base + second, o2, pair, k_scale, MODEL, FP8)
        else:
            key = tl.load(pool_key_ptr + src_base + d, mask=in_head)
            _store(key_cache_ptr, dst_base + d, key, in_head, k_scale, MODEL, FP8)

    @triton.jit
    def _fused_capture_kernel(
        tables_ptr,
        num_layers,
        num_rows,
        num_heads,
        src_slots_ptr,
        dst_rows_ptr,
        pool_row_stride,
        pool_head_stride,
        block_stride,
        page_stride,
        head_stride,
        block_size,
        HEAD_SIZE: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DTYPE: tl.constexpr,
        ROWS: tl.constexpr,
        HEADS: tl.constexpr,
    ):
        # The load's inverse, a plain copy: paged slots -> pool rows.
        entry, head, live = _tile(num_rows, num_heads, ROWS, HEADS)
        layer = tl.program_id(2)
        pool_key_ptr = _layer_ptr(tables_ptr, 0, num_layers, layer, DTYPE)
        pool_value_ptr = _layer_ptr(tables_ptr, 1, num_layers, layer, DTYPE)
        key_cache_ptr = _layer_ptr(tables_ptr, 2, num_layers, layer, DTYPE)
        value_cache_ptr = _layer_ptr(tables_ptr, 3, num_layers, layer, DTYPE)
        slot = tl.load(src_slots_ptr + entry, mask=live, other=0)
        dst = tl.load(dst_rows_ptr + entry, mask=live, other=0)
        src_base = _paged_offset(
            slot, head, block_size, block_stride, page_stride, head_stride
        )
        dst_base = (dst * pool_row_stride + head * pool_head_stride)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        in_head = live[:, None] & (d < HEAD_SIZE)
        key = tl.load(key_cache_ptr + src_base + d, mask=in_head)
        tl.store(pool_key_ptr + dst_base + d, key, mask=in_head)
        value = tl.load(value_cache_ptr + src_base + d, mask=in_head)
        tl.store(pool_value_ptr + dst_base + d, value, mask=in_head)


# The pool's (model's) dtype as the kernel's MODEL code, and as Triton's type.
_MODEL_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_TL_DTYPES = (
    {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if triton is not None
    else {}
)


def available(device: torch.device | None = None) -> bool:
    """Whether the kernels run on `device` (on the CPU: in Triton's interpreter
    only, TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    if device is not None and device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return True


@dataclass(frozen=True)
class FusedGroup:
    """Layers one launch loads (the same pool and cache shapes, strides and
    dtypes), found by the kernel through a table of their device addresses:
    the tensors must not move (the worker's pool and vLLM's paged cache,
    allocated once). Built at the first load: fused_chunk_load_path.py."""

    # [6, num_layers] int64 addresses (the kernels' `_layer_ptr`).
    tables: torch.Tensor
    num_layers: int
    num_heads: int
    head_size: int
    pool_dtype: torch.dtype
    fp8: bool
    scale_stride: int
    pool_strides: tuple[int, int]
    cache_strides: tuple[int, int, int]
    block_size: int
    # Keeps the tensors behind the addresses alive.
    tensors: tuple

    @classmethod
    def of(
        cls,
        pool_keys: list[torch.Tensor],
        pool_values: list[torch.Tensor],
        layers: list[PagedLayer],
    ) -> FusedGroup:
        first_k, first = pool_keys[0], layers[0]
        _, num_heads, head_size = first_k.shape
        fp8 = first.key_cache.dtype == torch.float8_e4m3fn
        scales: list[torch.Tensor] = []
        pool_form = (first_k.shape[1:], first_k.stride(), first_k.dtype)
        cache_form = (first.key_cache.shape, first.key_cache.dtype)
        for k, v, layer in zip(pool_keys, pool_values, layers):
            if k.stride(2) != 1 or (v.shape, v.stride()) != (k.shape, k.stride()):
                raise ValueError("pool K/V must share one layout, heads contiguous")
            if (k.shape[1:], k.stride(), k.dtype) != pool_form:
                raise ValueError(
                    "a fused group's pools must share shape, strides and dtype"
                )
            for cache in (layer.key_cache, layer.value_cache):
                if cache.stride() != first.key_cache.stride() or cache.stride(3) != 1:
                    raise ValueError(
                        "paged K/V caches must share strides, head contiguous"
                    )
                if (cache.shape, cache.dtype) != cache_form:
                    raise ValueError(
                        "a fused group's caches must share shape and dtype"
                    )
            if not fp8 and layer.key_cache.dtype != k.dtype:
                raise ValueError(
                    f"cache dtype {layer.key_cache.dtype} is neither the pool's "
                    "nor fp8 e4m3"
                )
            if fp8:
                if layer.k_scale is None or layer.v_scale is None:
                    raise ValueError("an fp8 cache needs k_scale and v_scale")
                scales += [
                    s.to(torch.float32).contiguous()
                    for s in (layer.k_scale, layer.v_scale)
                ]
        sizes = {s.numel() for s in scales}
        if sizes - {1, num_heads} or len(sizes) > 1:
            raise ValueError(
                f"k/v scales must be [1] or [num_heads], got sizes {sizes}"
            )
        # No scales (not fp8): pool K's addresses stand in, never read.
        pool_key_addresses = [k.data_ptr() for k in pool_keys]
        addresses = [
            pool_key_addresses,
            [v.data_ptr() for v in pool_values],
            [layer.key_cache.data_ptr() for layer in layers],
            [layer.value_cache.data_ptr() for layer in layers],
            [s.data_ptr() for s in scales[0::2]] or pool_key_addresses,
            [s.data_ptr() for s in scales[1::2]] or pool_key_addresses,
        ]
        tables = torch.tensor(addresses, dtype=torch.int64).to(first_k.device)
        return cls(
            tables=tables,
            num_layers=len(layers),
            num_heads=num_heads,
            head_size=head_size,
            pool_dtype=first_k.dtype,
            fp8=fp8,
            scale_stride=0 if not fp8 or scales[0].numel() == 1 else 1,
            pool_strides=(first_k.stride(0), first_k.stride(1)),
            cache_strides=tuple(first.key_cache.stride()[:3]),
            block_size=first.key_cache.shape[1],
            tensors=(
                tuple(pool_keys),
                tuple(pool_values),
                tuple(layers),
                tuple(scales),
            ),
        )


def fused_load(
    group: FusedGroup,
    src_rows: torch.Tensor,
    dst_slots: torch.Tensor,
    delta_index: torch.Tensor | None,
    cos_sin_table: tuple[torch.Tensor, torch.Tensor] | None,
    is_neox_style: bool,
    rotary_dim: int,
    *,
    geometry: LaunchGeometry = DEFAULT_LOAD_GEOMETRY,
) -> None:
    """One launch: pool rows `src_rows` [n] of every layer of `group` to
    paged slots `dst_slots` [n], K rotated by row: `delta_index` [n] indexes
    `cos_sin_table` ([entries, rotary_dim // 2] fp32 each); None: no RoPE."""
    if triton is None:
        raise RuntimeError("the fused chunk load needs Triton")
    num_rows = src_rows.shape[0]
    if num_rows == 0:
        return
    rotate = delta_index is not None
    if delta_index is not None:
        if cos_sin_table is None:
            raise ValueError("a rotated load needs its cos/sin table")
        cos, sin = (t.contiguous() for t in cos_sin_table)
        rot_half = rotary_dim // 2
    else:
        cos = sin = group.tables  # unused
        delta_index = src_rows
        rot_half = 1
    tl_pool = _TL_DTYPES[group.pool_dtype]
    _fused_load_kernel[geometry.grid(num_rows, group.num_heads, group.num_layers)](
        group.tables,
        group.num_layers,
        num_rows,
        group.num_heads,
        src_rows,
        dst_slots,
        delta_index,
        cos,
        sin,
        group.scale_stride,
        *group.pool_strides,
        *group.cache_strides,
        group.block_size,
        HEAD_SIZE=group.head_size,
        ROT_HALF=rot_half,
        BLOCK_D=triton.next_power_of_2(group.head_size),
        BLOCK_HALF=triton.next_power_of_2(rot_half),
        IS_NEOX=is_neox_style,
        ROTATE=rotate,
        MODEL=_MODEL_CODES[group.pool_dtype],
        FP8=group.fp8,
        POOL_DTYPE=tl_pool,
        CACHE_DTYPE=tl.float8e4nv if group.fp8 else tl_pool,
        # NOTE: no FMA contraction: the generic rotation rounds each product.
        enable_fp_fusion=False,
        **geometry.options(),
    )


def fused_capture(
    group: FusedGroup,
    src_slots: torch.Tensor,
    dst_rows: torch.Tensor,
    *,
    geometry: LaunchGeometry = DEFAULT_CAPTURE_GEOMETRY,
) -> None:
    """One launch: the rows at paged slots `src_slots` [n] of every layer of
    `group` into pool rows `dst_rows` [n] (caches in the pool's dtype only)."""
    if triton is None:
        raise RuntimeError("the fused chunk capture needs Triton")
    if group.fp8:
        raise ValueError("an fp8 cache's bytes are not the rows: captured in the hook")
    num_rows = src_slots.shape[0]
    if num_rows == 0:
        return
    _fused_capture_kernel[geometry.grid(num_rows, group.num_heads, group.num_layers)](
        group.tables,
        group.num_layers,
        num_rows,
        group.num_heads,
        src_slots,
        dst_rows,
        *group.pool_strides,
        *group.cache_strides,
        group.block_size,
        HEAD_SIZE=group.head_size,
        BLOCK_D=triton.next_power_of_2(group.head_size),
        DTYPE=_TL_DTYPES[group.pool_dtype],
        **geometry.options(),
    )
