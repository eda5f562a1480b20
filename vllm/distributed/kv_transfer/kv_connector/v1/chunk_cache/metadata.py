# SPDX-License-Identifier: Apache-2.0
"""The boundary between the connector's scheduler half and its workers.

Loads and captures travel as block ids, vLLM's own currency: per request its
paged blocks, per cached segment its pool blocks and the stretch to copy,
and the workers expand them into rows (`LoadRows.expand`,
`StoreRows.expand`; both address rows with `rows_of_blocks`). A step of 64
documents of 500 tokens ships a few hundred integers instead of three lists
of 32,000 (docs/benchmarks.md).
"""

from dataclasses import dataclass, field

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.chunk_structures import SegmentLoad


def rows_of_blocks(
    block_ids: tuple[int, ...] | np.ndarray, block_size: int, positions: np.ndarray
) -> np.ndarray:
    """Flat row (block_id * block_size + offset) of each position of a
    sequence stored in `block_ids` (paged blocks or pool blocks alike)."""
    blocks = np.asarray(block_ids, dtype=np.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


@dataclass(frozen=True)
class SegmentStretch:
    """Rows [first_row, first_row + num_rows) of one cached segment, copied
    to the request's positions from `dst_position` on, K rotated by `delta`."""

    # The segment's pool blocks, in row order.
    pool_block_ids: tuple[int, ...]
    first_row: int
    num_rows: int
    dst_position: int
    delta: int

    @classmethod
    def of(cls, seg: SegmentLoad) -> "SegmentStretch":
        """The stretch of a manager's planned segment load."""
        return cls(
            pool_block_ids=tuple(int(b) for b in seg.pool_block_ids),
            first_row=seg.first_row,
            num_rows=seg.row_end - seg.first_row,
            dst_position=seg.dst_start + seg.first_row,
            delta=seg.position_delta,
        )


@dataclass(frozen=True)
class RequestLoad:
    """What one request loads in this step."""

    # The request's paged blocks (of its single KV cache group).
    block_ids: tuple[int, ...]
    stretches: tuple[SegmentStretch, ...]


@dataclass(frozen=True)
class LoadRows:
    """A step's loads as rows: pool row -> paged slot, and the K rotation."""

    src_rows: np.ndarray
    dst_slots: np.ndarray
    deltas: np.ndarray

    @classmethod
    def expand(cls, loads: list[RequestLoad], pool_block_size: int,
               block_size: int) -> "LoadRows":
        src, dst, deltas = [], [], []
        for load in loads:
            # NOTE: converted once per request, not per stretch (thousands of
            # blocks at 64 documents).
            blocks = np.asarray(load.block_ids, dtype=np.int64)
            for s in load.stretches:
                rows = np.arange(s.first_row, s.first_row + s.num_rows, dtype=np.int64)
                src.append(rows_of_blocks(s.pool_block_ids, pool_block_size, rows))
                positions = rows - s.first_row + s.dst_position
                dst.append(rows_of_blocks(blocks, block_size, positions))
                deltas.append(np.full(s.num_rows, s.delta, dtype=np.int64))
        if not src:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, empty)
        return cls(np.concatenate(src), np.concatenate(dst), np.concatenate(deltas))


@dataclass(frozen=True)
class ChildStore:
    """What one child computes in this step and the pool keeps: positions
    [first_position, end_position) of its sequence, from its paged blocks
    to its entry's row `position - store_start`."""

    # The child's paged blocks (of its single KV cache group).
    block_ids: tuple[int, ...]
    # Its entry's pool blocks, in row order.
    pool_block_ids: tuple[int, ...]
    first_position: int
    end_position: int
    # The first position stored (the segment's; before it, the context).
    store_start: int


@dataclass(frozen=True)
class StoreRows:
    """A step's captures as rows: paged slot -> pool row."""

    src_slots: np.ndarray
    dst_rows: np.ndarray

    @classmethod
    def expand(cls, stores: list[ChildStore], pool_block_size: int,
               block_size: int) -> "StoreRows":
        src, dst = [], []
        for s in stores:
            positions = np.arange(s.first_position, s.end_position, dtype=np.int64)
            src.append(rows_of_blocks(s.block_ids, block_size, positions))
            dst.append(rows_of_blocks(s.pool_block_ids, pool_block_size,
                                      positions - s.store_start))
        if not src:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty)
        return cls(np.concatenate(src), np.concatenate(dst))


@dataclass
class ChunkCacheMetadata(KVConnectorMetadata):
    """One step's work for the workers."""

    # Load: per request, its stretches of cached segments (block ids).
    loads: list[RequestLoad] = field(default_factory=list)
    # Capture: per child, the stretch it computes in this step (block ids).
    stores: list[ChildStore] = field(default_factory=list)
