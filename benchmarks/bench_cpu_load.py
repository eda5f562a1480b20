#!/usr/bin/env python3
"""The CPU load of one all-hit request's rows, per layer and request (issue 52, item 1).

One all-hit request of N documents of ~500 tokens on the host workload's shapes (tiny-llama:
4 layers, 2 KV heads of 32 (`--head`), bf16, block size 128, the "vec" cache layout), its rows expanded by
`LoadRows.expand` from shuffled pool blocks, then loaded by `PositionRemapper.remap_layer`
through vLLM's own `cpu_attn_reshape_and_cache` as the worker does, in pieces of
`--pieces` rows (16384: --max-chunk-load-tokens' default, the worker's pieces before issue 52).
The pieces are timed interleaved in one run on `--threads` threads (1 by default); medians and the ratio to the
first. Every variant's cache bytes are checked equal to the first's before timing.

Also printed: each pass alone over all rows (the gather, the casts, the rotation, the write),
and the write done instead by one indexed copy per side into the cache's own layout (its
bytes checked equal to the op's first), to show where the time is and what the pieces and
the alternative change.

    OMP_NUM_THREADS=1 .cache/venv/bin/python benchmarks/bench_cpu_load.py [--docs 64] \
        [--dtype bfloat16] [--pieces 16384 1024 256] [--threads 2] [--head 64]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

LAYERS, HEADS, HEAD, BLOCK, POOL_BLOCK = 4, 2, 32, 128, 16


def _rows(num_docs: int, doc_tokens: int, pool_rows: int):
    import torch

    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
        LoadRows,
        RequestLoad,
        SegmentStretch,
    )

    rng = random.Random(0)
    total = num_docs * doc_tokens + 64
    num_blocks = -(-total // BLOCK)
    table = tuple(rng.sample(range(num_blocks), num_blocks))
    pool_blocks = rng.sample(range(pool_rows // POOL_BLOCK), num_docs * -(-doc_tokens // POOL_BLOCK))
    stretches = []
    for i in range(num_docs):
        per = -(-doc_tokens // POOL_BLOCK)
        position = 8 + i * doc_tokens
        stretches.append(SegmentStretch(tuple(pool_blocks[i * per:(i + 1) * per]), 0,
                                        doc_tokens, position, position - 1))
    rows = LoadRows.expand([RequestLoad(table, tuple(stretches))], POOL_BLOCK, BLOCK,
                           torch.device("cpu"))
    return rows, num_blocks


def main() -> None:
    global HEAD
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=500)
    ap.add_argument("--head", type=int, default=HEAD, help="head size (32: tiny-llama's)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--pieces", type=int, nargs="+", default=[16384, 2048, 1024, 512, 256])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    ap.add_argument("--inductor", action="store_true",
                    help="also K's gather, casts and rotation as one loop compiled by "
                         "torch.compile (inductor's C++; compiles for ~30 s)")
    ap.add_argument("--cold-write", type=float, default=0.0, metavar="GIB",
                    help="also the write alone into a paged cache of GIB over the layers: "
                         "the same blocks every request (warm) against the next blocks of "
                         "the cache every request (cold, as vLLM's free queue hands out its "
                         "least recently used blocks)")
    args = ap.parse_args()
    HEAD = args.head

    import torch

    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from vllm.v1.worker.position_remapper import (
        PositionRemapper,
        RemapRows,
        RemapScratch,
        RopeRotation,
    )

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    isa = _get_attn_isa(dtype, BLOCK, HEAD, "auto")
    pool_rows = 4 * args.docs * args.doc_tokens
    rows, num_blocks = _rows(args.docs, args.doc_tokens, pool_rows)
    n = rows.src_rows.shape[0]
    gen = torch.Generator().manual_seed(0)
    pool_k = [torch.randn(pool_rows, HEADS, HEAD, generator=gen).to(dtype) for _ in range(LAYERS)]
    pool_v = [torch.randn(pool_rows, HEADS, HEAD, generator=gen).to(dtype) for _ in range(LAYERS)]
    caches = [torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD, dtype=dtype) for _ in range(LAYERS)]
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(HEAD, 1 << 17, True, {"rope_type": "default", "rope_theta": 10000.0},
                        torch.float32)
    rotation = RopeRotation(rope)
    stretches = rotation.stretch_cos_sin(rows.stretch_deltas, torch.device("cpu"))

    def write(layer_name, key, value, slots):
        paged = caches[int(layer_name)].view(num_blocks, HEADS, BLOCK * 2, -1)
        key_cache, value_cache = paged.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    all_rows = RemapRows(rows.src_rows, rows.dst_slots, rows.deltas, rows.stretch_index,
                         rows.stretch_deltas)

    def load(piece_rows: int) -> None:
        remapper = remappers[piece_rows]
        for piece in all_rows.pieces(piece_rows):
            for layer in range(LAYERS):
                remapper.remap_layer(str(layer), pool_k[layer], pool_v[layer], piece, stretches)

    remappers = {p: PositionRemapper(rotation, write, RemapScratch(p)) for p in args.pieces}
    print(f"{args.docs} documents x {args.doc_tokens} tokens = {n} rows, {LAYERS} layers, "
          f"{HEADS}x{HEAD} {args.dtype}, isa {isa}, rotation: {rotation.describe_path(torch.device('cpu'))}")
    reference = None
    for p in args.pieces:
        for c in caches:
            c.zero_()
        load(p)
        got = torch.cat([c.flatten() for c in caches])
        if reference is None:
            reference = got.clone()
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           reference.view(torch.int16 if dtype != torch.float32 else torch.int32)), p
    times: dict[int, list[float]] = {p: [] for p in args.pieces}
    for _ in range(args.reps):
        for p in args.pieces:
            t = time.perf_counter()
            load(p)
            times[p].append(time.perf_counter() - t)
    base = statistics.median(times[args.pieces[0]])
    for p in args.pieces:
        med = statistics.median(times[p])
        print(f"  pieces of {p:6d} rows: {1e3 * med:7.2f} ms a request  ({med / base:.2f}x)")

    # Each pass alone over all rows of one layer (x LAYERS), for the breakdown.
    key = torch.empty(n, HEADS, HEAD, dtype=dtype)
    value = torch.empty_like(key)
    key32 = torch.empty(n, HEADS, HEAD, dtype=torch.float32)
    table = stretches.op_table()

    def passes():
        out = {}
        t = time.perf_counter()
        torch.index_select(pool_k[0].flatten(1), 0, rows.src_rows, out=key.flatten(1))
        out["gather K"] = time.perf_counter() - t
        t = time.perf_counter()
        torch.index_select(pool_v[0].flatten(1), 0, rows.src_rows, out=value.flatten(1))
        out["gather V"] = time.perf_counter() - t
        if dtype != torch.float32:
            t = time.perf_counter()
            key32.copy_(key)
            out["cast K to fp32"] = time.perf_counter() - t
        t = time.perf_counter()
        rotation.rotate_in_place_indexed(key32 if dtype != torch.float32 else key,
                                         rows.stretch_index, table)
        out["rotate K"] = time.perf_counter() - t
        if dtype != torch.float32:
            t = time.perf_counter()
            key.copy_(key32)
            out["cast K back"] = time.perf_counter() - t
        t = time.perf_counter()
        write("0", key, value, rows.dst_slots)
        out["write K+V"] = time.perf_counter() - t
        if isa in ("vec", "vec16"):
            # The alternative: one indexed copy per side into the layout the op packs
            # ("vec": per block and head, K as [head, block], V as [block, head]).
            t = time.perf_counter()
            by_index(key, value, rows.dst_slots)
            out["write by index"] = time.perf_counter() - t
        return out

    def by_index(key, value, slots):
        c4 = by_index_cache.view(num_blocks, HEADS, 2, BLOCK * HEAD)
        keys = c4[:, :, 0].view(num_blocks, HEADS, HEAD, BLOCK).permute(0, 3, 1, 2)
        values = c4[:, :, 1].view(num_blocks, HEADS, BLOCK, HEAD).transpose(1, 2)
        index = (slots // BLOCK, slots % BLOCK)
        keys.index_put_(index, key)
        values.index_put_(index, value)

    by_index_cache = torch.zeros_like(caches[0])
    caches[0].zero_()
    passes()
    if isa in ("vec", "vec16"):
        assert torch.equal(by_index_cache.view(torch.int16), caches[0].view(torch.int16)), \
            "the indexed copy must write the op's bytes"

    if args.inductor:
        _inductor(args, rows, pool_k[0], stretches, key, key32, rotation, table)
    samples = [passes() for _ in range(args.reps)]
    print(f"  each pass alone, all {n} rows at once, x {LAYERS} layers:")
    for name in samples[0]:
        print(f"    {name:16s} {1e3 * LAYERS * statistics.median(s[name] for s in samples):7.2f} ms")
    if args.cold_write:
        _cold_write(args, n, dtype, isa)


def _inductor(args, rows, pool, stretches, key, key32, rotation, table) -> None:
    """K's gather + fp32 rotation + cast as one compiled loop, against the passes it
    would replace (gather, cast, vLLM's rotation op, cast back), on one layer."""
    import torch

    half = HEAD // 2

    def fused(pool, src, index, cos, sin):
        k = pool[src].float()
        c, s = cos[index][:, None], sin[index][:, None]
        x1, x2 = k[..., :half], k[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(pool.dtype)

    def passes():
        torch.index_select(pool.flatten(1), 0, rows.src_rows, out=key.flatten(1))
        target = key
        if key.dtype != torch.float32:
            target = key32
            key32.copy_(key)
        rotation.rotate_in_place_indexed(target, rows.stretch_index, table)
        if target is not key:
            key.copy_(key32)
        return key

    compiled = torch.compile(fused, dynamic=True)
    t = time.perf_counter()
    out = compiled(pool, rows.src_rows, rows.stretch_index, stretches.cos, stretches.sin)
    print(f"  inductor: compiled in {time.perf_counter() - t:.1f} s")
    same = torch.equal(out.flatten(), passes().flatten())
    times = {"passes": [], "compiled": []}
    for _ in range(args.reps):
        for name in times:
            t = time.perf_counter()
            if name == "passes":
                passes()
            else:
                compiled(pool, rows.src_rows, rows.stretch_index, stretches.cos, stretches.sin)
            times[name].append(time.perf_counter() - t)
    p, c = (1e3 * statistics.median(times[k]) for k in ("passes", "compiled"))
    print(f"  K of one layer: gather, casts, rotation as passes {p:.2f} ms, as one compiled "
          f"loop {c:.2f} ms ({c / p:.2f}x); bit-identical: {same}")


def _cold_write(args, n: int, dtype, isa: str) -> None:
    """The write op of one request's rows into a large cache: warm blocks against cold.

    NOTE (issue 52, third pass): the engine's write was said to cost 12 ms at 32k against
    this script's 5.2; one suspect was the engine's destination blocks, cold in a cache of
    gigabytes. Interleaved here, one thread."""
    import torch

    from vllm import _custom_ops as ops

    block_bytes = HEADS * BLOCK * 2 * HEAD * torch.empty((), dtype=dtype).element_size()
    num_blocks = int(args.cold_write * (1 << 30) / block_bytes / LAYERS)
    request_blocks = -(-n // BLOCK)
    if num_blocks < 3 * request_blocks:
        raise SystemExit(f"--cold-write {args.cold_write}: too small for {n} rows")
    caches = [torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD, dtype=dtype)
              for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(n, HEADS, HEAD, generator=gen).to(dtype)
    value = torch.randn(n, HEADS, HEAD, generator=gen).to(dtype)

    small = [torch.zeros(request_blocks, HEADS, BLOCK, 2 * HEAD, dtype=dtype)
             for _ in range(LAYERS)]

    def write(layers: list, first_block: int) -> float:
        slots = torch.arange(first_block * BLOCK, first_block * BLOCK + n)
        t = time.perf_counter()
        for cache in layers:
            paged = cache.view(cache.shape[0], HEADS, BLOCK * 2, -1)
            key_cache, value_cache = paged.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"small": [], "warm": [], "cold": []}
    first = request_blocks
    for _ in range(2 * args.reps):
        times["small"].append(write(small, 0))
        times["warm"].append(write(caches, 0))
        times["cold"].append(write(caches, first))
        first = first + request_blocks
        if first + request_blocks > num_blocks:
            first = request_blocks
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(f"  the write alone, {n} rows x {LAYERS} layers, interleaved: into a cache of "
          f"just their blocks {ms['small']:.2f} ms; into a cache of {args.cold_write} GiB "
          f"({num_blocks} blocks a layer), the same blocks every time {ms['warm']:.2f} ms, "
          f"the next blocks every time (cold) {ms['cold']:.2f} ms")


if __name__ == "__main__":
    main()
