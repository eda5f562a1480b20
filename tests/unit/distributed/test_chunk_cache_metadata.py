# SPDX-License-Identifier: Apache-2.0
"""The connector metadata's block-id descriptors and their one expansion into
rows (what each worker does once per step, on its device), with exact rows."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
    ChildStore,
    LoadRows,
    RequestLoad,
    SegmentStretch,
    StoreRows,
)

CPU = torch.device("cpu")


def test_rows_follow_the_blocks():
    # Rows 0..5 of an entry in pool blocks (7, 2) of 4 rows, to positions
    # 0..5 of a request in paged blocks (1, 3) of 8 slots.
    stretch = SegmentStretch(
        pool_block_ids=(7, 2), first_row=0, num_rows=6, dst_position=0, delta=3
    )
    rows = LoadRows.expand(
        [RequestLoad(block_ids=(1, 3), stretches=(stretch,))], 4, 8, CPU
    )
    assert rows.src_rows.tolist() == [28, 29, 30, 31, 8, 9]
    assert rows.dst_slots.tolist() == [8, 9, 10, 11, 12, 13]


def test_a_load_expands_to_pool_rows_paged_slots_and_deltas():
    # Rows 2..5 of an entry in pool blocks (3, 1) of 4 rows, loaded at
    # positions 6..9 of a request whose paged blocks are (5, 0, 9) of 4 slots.
    stretch = SegmentStretch(
        pool_block_ids=(3, 1), first_row=2, num_rows=4, dst_position=6, delta=-7
    )
    other = SegmentStretch(
        pool_block_ids=(8,), first_row=0, num_rows=1, dst_position=0, delta=0
    )
    rows = LoadRows.expand(
        [
            RequestLoad(block_ids=(5, 0, 9), stretches=(stretch,)),
            RequestLoad(block_ids=(4,), stretches=(other,)),
        ],
        4,
        4,
        CPU,
    )
    assert rows.src_rows.tolist() == [14, 15, 4, 5, 32]
    assert rows.dst_slots.tolist() == [2, 3, 36, 37, 16]
    assert rows.deltas.tolist() == [-7, -7, -7, -7, 0]


def test_a_capture_expands_to_paged_slots_and_pool_rows():
    # Positions 3..6 of a child in paged blocks (6, 2) of 4 slots; its entry
    # starts at position 1 (the sink before it) in pool blocks (0, 5).
    store = ChildStore(
        block_ids=(6, 2),
        pool_block_ids=(0, 5),
        first_position=3,
        end_position=7,
        store_start=1,
    )
    rows = StoreRows.expand([store], 4, 4, CPU)
    assert rows.src_slots.tolist() == [27, 8, 9, 10]
    assert rows.dst_rows.tolist() == [2, 3, 20, 21]


def test_nothing_to_expand():
    assert LoadRows.expand([], 16, 16, CPU).src_rows.numel() == 0
    assert StoreRows.expand([], 16, 16, CPU).dst_rows.numel() == 0


def test_stretches_of_one_request_share_its_block_table(monkeypatch):
    """What crosses to the device is one array: six integers per stretch, then each
    block table once, however many stretches use it (observed on the array handed to
    torch, not on the rows, which would be the same either way)."""
    shipped = []
    from_numpy = torch.from_numpy

    def spy(array):
        shipped.append(array.copy())
        return from_numpy(array)

    monkeypatch.setattr(torch, "from_numpy", spy)
    # Two stretches of one request and one of another.
    a = SegmentStretch(
        pool_block_ids=(0,), first_row=0, num_rows=2, dst_position=0, delta=1
    )
    b = SegmentStretch(
        pool_block_ids=(1,), first_row=1, num_rows=2, dst_position=2, delta=2
    )
    c = SegmentStretch(
        pool_block_ids=(2,), first_row=0, num_rows=1, dst_position=1, delta=3
    )
    rows = LoadRows.expand(
        [
            RequestLoad(block_ids=(9,), stretches=(a, b)),
            RequestLoad(block_ids=(5,), stretches=(c,)),
        ],
        4,
        4,
        CPU,
    )
    (packed,) = shipped
    tables = packed[6 * 3 :].tolist()
    # Paged tables (9,) and (5,), pool tables (0,), (1,), (2,): each once.
    assert sorted(tables) == [0, 1, 2, 5, 9]
    assert rows.src_rows.tolist() == [0, 1, 5, 6, 8]
    assert rows.dst_slots.tolist() == [36, 37, 38, 39, 21]
    assert rows.deltas.tolist() == [1, 1, 2, 2, 3]


def test_each_row_knows_its_stretch_and_each_stretch_its_delta():
    # Two requests, three stretches: the fused load's cos/sin table has a row per
    # stretch, and row i reads entry stretch_index[i] of it. Expected rows worked out
    # by hand from the blocks (4 rows per pool block, 4 slots per paged block).
    a = RequestLoad(
        block_ids=(4, 5),
        stretches=(
            SegmentStretch(
                pool_block_ids=(9,), first_row=0, num_rows=2, dst_position=1, delta=1
            ),
            SegmentStretch(
                pool_block_ids=(8,), first_row=1, num_rows=3, dst_position=3, delta=2
            ),
        ),
    )
    b = RequestLoad(
        block_ids=(6,),
        stretches=(
            SegmentStretch(
                pool_block_ids=(7,), first_row=0, num_rows=1, dst_position=2, delta=-5
            ),
        ),
    )
    rows = LoadRows.expand([a, b], 4, 4, torch.device("cpu"))
    got = list(
        zip(
            rows.src_rows.tolist(),
            rows.dst_slots.tolist(),
            rows.stretch_index.tolist(),
            rows.deltas.tolist(),
        )
    )
    assert got == [
        (36, 17, 0, 1),
        (37, 18, 0, 1),  # pool block 9 -> positions 1, 2
        (33, 19, 1, 2),
        (34, 20, 1, 2),
        (35, 21, 1, 2),  # block 8 -> 3..5
        (28, 26, 2, -5),
    ]  # pool block 7 -> position 2 of block 6
    assert rows.stretch_deltas.tolist() == [1, 2, -5]


def test_a_stretch_from_a_position_keeps_exactly_the_rows_at_or_after_it():
    """Issue 42: loads into a sliding-window group skip the rows of the blocks vLLM's
    SlidingWindowManager null-padded (out of every later token's window). Oracle:
    the untrimmed expansion with the rows before the position filtered out."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.scheduler_adapter import (  # noqa: E501
        _leading_null_blocks,
    )

    blocks = (0, 0, 6, 2)  # two null blocks first: positions 0..7 are skipped
    skipped = _leading_null_blocks(list(blocks)) * 4
    assert skipped == 8 and _leading_null_blocks([3, 0, 5]) == 0
    stretches = (
        SegmentStretch((3, 1, 5), first_row=1, num_rows=9, dst_position=2, delta=4),
        SegmentStretch((7,), first_row=0, num_rows=3, dst_position=12, delta=-1),
        SegmentStretch((9,), first_row=0, num_rows=2, dst_position=5, delta=2),
    )
    full = LoadRows.expand([RequestLoad(blocks, stretches)], 4, 4, CPU)
    trimmed = [
        t for t in (s.from_position(skipped) for s in stretches) if t is not None
    ]
    assert len(trimmed) == 2  # the last stretch lies entirely in the null blocks
    assert trimmed[1] is stretches[1]  # untouched when nothing is before the position
    rows = LoadRows.expand([RequestLoad(blocks, tuple(trimmed))], 4, 4, CPU)
    keep = full.dst_slots >= 4  # the rows into the null block (slots 0..3) are dropped
    assert rows.src_rows.tolist() == full.src_rows[keep].tolist()
    assert rows.dst_slots.tolist() == full.dst_slots[keep].tolist()
    assert rows.deltas.tolist() == full.deltas[keep].tolist()
    assert bool(keep.any()) and not bool(keep.all())


# --- the vectorised expansion against a row-by-row reference (issue 52) ---


def _reference_rows(blocks, first, count, block_size):
    """Row by row, the definition: position p of a sequence kept in `blocks`
    lives in block blocks[p // block_size], at offset p % block_size."""
    return [
        blocks[p // block_size] * block_size + p % block_size
        for p in range(first, first + count)
    ]


@st.composite
def _load_layouts(draw):
    """Random steps: requests with paged tables, stretches with pool tables,
    first rows and positions anywhere inside a block (partial first and last
    blocks), empty stretches, and pool blocks of another size than paged ones."""
    pool_block_size = draw(st.sampled_from([1, 3, 4, 16]))
    block_size = draw(st.sampled_from([1, 2, 4, 5, 16, 128]))
    loads = []
    for _ in range(draw(st.integers(0, 3))):
        num_blocks = draw(st.integers(1, 6))
        table = tuple(
            draw(
                st.lists(st.integers(0, 999), min_size=num_blocks, max_size=num_blocks)
            )
        )
        capacity = num_blocks * block_size
        stretches = []
        for _ in range(draw(st.integers(0, 4))):
            first_row = draw(st.integers(0, 2 * pool_block_size))
            dst_position = draw(st.integers(0, capacity))
            num_rows = draw(st.integers(0, capacity - dst_position))
            needed = -(-(first_row + num_rows) // pool_block_size)
            pool = tuple(
                draw(
                    st.lists(st.integers(0, 999), min_size=needed, max_size=needed + 2)
                )
            )
            stretches.append(
                SegmentStretch(
                    pool, first_row, num_rows, dst_position, draw(st.integers(-50, 50))
                )
            )
        loads.append(RequestLoad(table, tuple(stretches)))
    return loads, pool_block_size, block_size


@settings(max_examples=300, deadline=None)
@given(_load_layouts())
def test_the_expansion_equals_the_row_by_row_definition(layout):
    loads, pool_block_size, block_size = layout
    src, dst, deltas, index, stretch_deltas = [], [], [], [], []
    for load in loads:
        for stretch in load.stretches:
            src += _reference_rows(
                stretch.pool_block_ids,
                stretch.first_row,
                stretch.num_rows,
                pool_block_size,
            )
            dst += _reference_rows(
                load.block_ids, stretch.dst_position, stretch.num_rows, block_size
            )
            deltas += [stretch.delta] * stretch.num_rows
            index += [len(stretch_deltas)] * stretch.num_rows
            stretch_deltas.append(stretch.delta)
    rows = LoadRows.expand(loads, pool_block_size, block_size, CPU)
    assert rows.src_rows.tolist() == src
    assert rows.dst_slots.tolist() == dst
    assert rows.deltas.tolist() == deltas
    assert rows.stretch_index.tolist() == index
    assert rows.stretch_deltas.tolist() == stretch_deltas
    for tensor in (rows.src_rows, rows.dst_slots, rows.deltas, rows.stretch_index):
        assert tensor.dtype == torch.int64


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 4, 16]), st.sampled_from([1, 3, 4, 16, 128]), st.data())
def test_a_capture_equals_the_row_by_row_definition(pool_block_size, block_size, data):
    stores, src, dst = [], [], []
    for _ in range(data.draw(st.integers(0, 4))):
        store_start = data.draw(st.integers(0, 3))
        first = data.draw(st.integers(store_start, store_start + 40))
        end = data.draw(st.integers(first, first + 40))
        paged = tuple(
            data.draw(
                st.lists(
                    st.integers(0, 999),
                    min_size=-(-end // block_size),
                    max_size=-(-end // block_size) + 1,
                )
            )
        )
        needed = -(-(end - store_start) // pool_block_size)
        pool = tuple(
            data.draw(
                st.lists(st.integers(0, 999), min_size=needed, max_size=needed + 1)
            )
        )
        stores.append(ChildStore(paged, pool, first, end, store_start))
        src += _reference_rows(paged, first, end - first, block_size)
        dst += _reference_rows(pool, first - store_start, end - first, pool_block_size)
    rows = StoreRows.expand(stores, pool_block_size, block_size, CPU)
    assert rows.src_slots.tolist() == src
    assert rows.dst_rows.tolist() == dst


def test_the_expansion_runs_no_python_per_row():
    """Issue 52: the same stretches, 40 times the rows, the same Python lines
    (the block arithmetic and the rows are numpy/torch work)."""
    from tests.unit.python_lines import python_lines

    def step(rows_per_stretch):
        stretches = tuple(
            SegmentStretch(
                tuple(range(10 * i, 10 * i + 60)),
                3,
                rows_per_stretch,
                1 + i * rows_per_stretch,
                i,
            )
            for i in range(4)
        )
        blocks = tuple(range(200, 200 + 4 * rows_per_stretch // 16 + 2))
        return [RequestLoad(blocks, stretches)]

    small, large = step(20), step(800)
    LoadRows.expand(small, 16, 16, CPU)  # first-call imports and caches
    assert python_lines(lambda: LoadRows.expand(large, 16, 16, CPU)) == python_lines(
        lambda: LoadRows.expand(small, 16, 16, CPU)
    )
