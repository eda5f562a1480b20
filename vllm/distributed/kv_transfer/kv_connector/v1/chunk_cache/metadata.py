# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The boundary between the connector's scheduler half and its workers.

Loads and captures travel as block ids (per request its paged blocks, per
cached segment its pool blocks and the stretch to copy); each worker expands
them into rows on its device (`_expand`, the one definition of "blocks ->
rows"): a few hundred integers a step instead of lists of 32,000 rows.
"""

from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.chunk_structures import SegmentLoad


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
        """The stretch of a manager's planned segment load (its pool block ids
        are Python ints already: no int() per block)."""
        return cls(
            pool_block_ids=tuple(seg.pool_block_ids),
            first_row=seg.first_row,
            num_rows=seg.row_end - seg.first_row,
            dst_position=seg.dst_start + seg.first_row,
            delta=seg.position_delta,
        )

    def from_position(self, position: int) -> "SegmentStretch | None":
        """This stretch without its rows copied to positions before `position`
        (None when none is left)."""
        skip = max(0, position - self.dst_position)
        if skip >= self.num_rows:
            return None
        if skip == 0:
            return self
        return SegmentStretch(
            self.pool_block_ids,
            self.first_row + skip,
            self.num_rows - skip,
            self.dst_position + skip,
            self.delta,
        )


@dataclass(frozen=True)
class RequestLoad:
    """What one request loads in this step."""

    # The request's paged blocks (of its single KV cache group).
    block_ids: tuple[int, ...]
    stretches: tuple[SegmentStretch, ...]


@dataclass(frozen=True)
class LoadRows:
    """A step's loads as rows on the device: pool row -> paged slot, and the K
    rotation of each (per row, and as an index into the step's per-stretch
    deltas, for a cos/sin table of one row per stretch)."""

    src_rows: torch.Tensor
    dst_slots: torch.Tensor
    deltas: torch.Tensor
    # Row -> its stretch; each stretch's delta, on the host (no read-back).
    stretch_index: torch.Tensor
    stretch_deltas: torch.Tensor

    @classmethod
    def expand(
        cls,
        loads: list[RequestLoad],
        pool_block_size: int,
        block_size: int,
        device: torch.device,
    ) -> "LoadRows":
        copies = [
            (s.pool_block_ids, s.first_row, load.block_ids, s.dst_position)
            + (s.num_rows, s.delta)
            for load in loads
            for s in load.stretches
        ]
        src, dst, which, deltas, host_deltas = _expand(
            copies, pool_block_size, block_size, device
        )
        return cls(src, dst, deltas[which], which, host_deltas)


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
    """A step's captures as rows on the device: paged slot -> pool row."""

    src_slots: torch.Tensor
    dst_rows: torch.Tensor

    @classmethod
    def expand(
        cls,
        stores: list[ChildStore],
        pool_block_size: int,
        block_size: int,
        device: torch.device,
    ) -> "StoreRows":
        copies = [
            (s.block_ids, s.first_position, s.pool_block_ids)
            + (s.first_position - s.store_start, s.end_position - s.first_position, 0)
            for s in stores
        ]
        src, dst, *_ = _expand(copies, block_size, pool_block_size, device)
        return cls(src, dst)


# `count` consecutive positions, K rotated by `delta`: from `src_first` on in
# the sequence stored in `src_blocks`, to `dst_first` on in `dst_blocks`
# (src_blocks, src_first, dst_blocks, dst_first, count, delta).
_Copy: TypeAlias = tuple[tuple[int, ...], int, tuple[int, ...], int, int, int]


def _expand(
    copies: list[_Copy], src_block_size: int, dst_block_size: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Every copied position's flat source and destination row (block_id *
    block_size + offset) and copy, each copy's delta, and each copy's delta
    on the host. Expanded on `device` from one host->device copy of the block
    tables (each once) and six integers per copy, with no host
    synchronisation: the row and piece counts are known on the host."""
    if not copies:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty, empty, empty, torch.zeros(0, dtype=torch.int64)
    tables: dict[int, int] = {}  # id(block tuple) -> offset in `flat`
    flat: list[np.ndarray] = []
    size = 0

    def offset_of(blocks: tuple[int, ...]) -> int:
        nonlocal size
        if id(blocks) not in tables:
            tables[id(blocks)] = size
            flat.append(np.asarray(blocks, dtype=np.int64))
            size += len(blocks)
        return tables[id(blocks)]

    per_copy = np.array(
        [
            (offset_of(sb), sf, offset_of(db), df, n, d)
            for sb, sf, db, df, n, d in copies
        ],
        dtype=np.int64,
    ).T
    total = int(per_copy[4].sum())
    packed = torch.from_numpy(np.concatenate([per_copy.reshape(-1)] + flat))
    if device.type != "cpu":
        packed = packed.pin_memory().to(device, non_blocking=True)
    num = len(copies)
    src_off, src_first, dst_off, dst_first, count, delta = packed[: 6 * num].view(
        6, num
    )
    blocks = packed[6 * num :]
    which = torch.repeat_interleave(
        torch.arange(num, device=device), count, output_size=total
    )
    # Each copy's row offset in the step; every row's index in the step,
    # from which both sides' rows are one add away (see _side_rows).
    row_offset = torch.cumsum(count, 0) - count
    steps = torch.arange(total, device=device)
    src_rows, dst_rows = (
        _side_rows(blocks, off, first, count, row_offset, steps, per_copy[[c, 4]], bs)
        for off, first, c, bs in (
            (src_off, src_first, 1, src_block_size),
            (dst_off, dst_first, 3, dst_block_size),
        )
    )
    # The deltas stay on the host too (a copy, not part of what is shipped).
    return src_rows, dst_rows, which, delta, torch.tensor(per_copy[5])


def _side_rows(
    blocks: torch.Tensor,
    table_off: torch.Tensor,
    first: torch.Tensor,
    count: torch.Tensor,
    row_offset: torch.Tensor,
    steps: torch.Tensor,
    host_first_count: np.ndarray,
    block_size: int,
) -> torch.Tensor:
    """One side's flat rows of every copied position, in step order. The
    block arithmetic runs per piece (a copy's part inside one block): inside
    it, row = (the piece's first row - its first step) + step."""
    num = first.numel()
    end = first + count
    spanned = torch.where(
        count > 0, (end - 1) // block_size - first // block_size + 1, 0
    )
    # The piece count from the host's copy: no device read-back.
    first_h, count_h = host_first_count
    spanned_h = (first_h + count_h - 1) // block_size - first_h // block_size + 1
    num_pieces = int(np.where(count_h > 0, spanned_h, 0).sum())
    copy = torch.repeat_interleave(
        torch.arange(num, device=blocks.device), spanned, output_size=num_pieces
    )
    nth = (
        torch.arange(num_pieces, device=blocks.device)
        - (torch.cumsum(spanned, 0) - spanned)[copy]
    )
    block = first[copy] // block_size + nth
    start = torch.maximum(first[copy], block * block_size)
    stop = torch.minimum(end[copy], (block + 1) * block_size)
    first_row = blocks[table_off[copy] + block] * block_size + (
        start - block * block_size
    )
    first_step = row_offset[copy] + (start - first[copy])
    return (
        torch.repeat_interleave(
            first_row - first_step, stop - start, output_size=steps.numel()
        )
        + steps
    )


@dataclass
class ChunkCacheMetadata(KVConnectorMetadata):
    """One step's work for the workers."""

    # Load: per request, its stretches of cached segments (block ids).
    loads: list[RequestLoad] = field(default_factory=list)
    # Capture: per child, the stretch it computes in this step (block ids).
    stores: list[ChildStore] = field(default_factory=list)
    # The store's reads and writes (store/messages.StoreStep), or None.
    store: Any = None
