#!/usr/bin/env python3
"""Worker-side expansion of a step's load descriptors into rows (issue 52).

One all-hit request of N documents of T tokens: `LoadRows.expand` (block
arithmetic once per block piece, then one repeat_interleave and one add per
side) against the same descriptors expanded with the block arithmetic done
per row (`_expand` as it was before issue 52, kept here as the
baseline), timed interleaved in one run on one thread. Prints medians and the
ratio; both outputs are checked equal first.

    .cache/venv/bin/python benchmarks/bench_load_rows.py [--docs 16 64 256] [--block 128]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def _per_row(loads, pool_block_size: int, block_size: int):
    """The pre-issue-52 expansion (metadata._expand at 6e7d5cf): the same
    packed descriptors, every row's block index, offset and table read
    computed per row."""
    import numpy as np
    import torch

    copies = [(s.pool_block_ids, s.first_row, load.block_ids, s.dst_position, s.num_rows,
               s.delta) for load in loads for s in load.stretches]
    tables: dict[int, int] = {}
    flat: list = []
    size = 0

    def offset_of(blocks):
        nonlocal size
        if id(blocks) not in tables:
            tables[id(blocks)] = size
            flat.append(np.asarray(blocks, dtype=np.int64))
            size += len(blocks)
        return tables[id(blocks)]

    per_copy = np.array([(offset_of(c[0]), c[1], offset_of(c[2]), c[3], c[4], c[5])
                         for c in copies], dtype=np.int64).T
    total = int(per_copy[4].sum())
    packed = torch.from_numpy(np.concatenate([per_copy.reshape(-1)] + flat))
    num = len(copies)
    src_off, src_first, dst_off, dst_first, count, delta = packed[:6 * num].view(6, num)
    blocks = packed[6 * num:]
    which = torch.repeat_interleave(torch.arange(num), count, output_size=total)
    local = torch.arange(total) - (torch.cumsum(count, 0) - count)[which]
    src = src_first[which] + local
    dst = dst_first[which] + local
    src_rows = (blocks[src_off[which] + src // pool_block_size] * pool_block_size
                + src % pool_block_size)
    dst_rows = blocks[dst_off[which] + dst // block_size] * block_size + dst % block_size
    return src_rows, dst_rows, delta[which]


def _loads(num_docs: int, doc_tokens: int, block_size: int, pool_block_size: int):
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
        RequestLoad,
        SegmentStretch,
    )

    rng = random.Random(0)
    total = num_docs * doc_tokens + 1
    table = tuple(rng.sample(range(1 << 20), -(-total // block_size)))
    stretches = []
    for i in range(num_docs):
        pool = tuple(rng.sample(range(1 << 20), -(-doc_tokens // pool_block_size)))
        position = 1 + i * doc_tokens
        stretches.append(SegmentStretch(pool, 0, doc_tokens, position, position - 1))
    return [RequestLoad(table, tuple(stretches))]


def main() -> None:
    import torch

    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import LoadRows
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import POOL_BLOCK_SIZE

    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--doc-tokens", type=int, default=500)
    parser.add_argument("--block", type=int, default=128, help="paged block size")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    print(f"paged block {args.block}, pool block {POOL_BLOCK_SIZE}, one thread")
    print(f"{'docs':>5} {'rows':>7} {'per-row ms':>11} {'expand ms':>10} {'ratio':>6}")
    for num_docs in args.docs:
        loads = _loads(num_docs, args.doc_tokens, args.block, POOL_BLOCK_SIZE)
        rows = LoadRows.expand(loads, POOL_BLOCK_SIZE, args.block, cpu)
        src, dst, deltas = _per_row(loads, POOL_BLOCK_SIZE, args.block)
        assert torch.equal(rows.src_rows, src) and torch.equal(rows.dst_slots, dst)
        assert torch.equal(rows.deltas, deltas)
        base, new = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            _per_row(loads, POOL_BLOCK_SIZE, args.block)
            base.append(time.perf_counter() - t)
            t = time.perf_counter()
            LoadRows.expand(loads, POOL_BLOCK_SIZE, args.block, cpu)
            new.append(time.perf_counter() - t)
        b, n = statistics.median(base) * 1e3, statistics.median(new) * 1e3
        print(f"{num_docs:>5} {rows.src_rows.numel():>7} {b:>11.3f} {n:>10.3f} {n / b:>6.2f}")


if __name__ == "__main__":
    main()
