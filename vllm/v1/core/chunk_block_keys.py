# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prefix-cache extra keys of a chunked prompt's paged blocks.

vLLM's prefix cache may share a chunked prompt's block only with a block
whose KV is the same under the chunk-isolation semantics. Block hashes are
chained, so a block is identified by its tokens, its parent and the segment
boundaries inside it with what starts there (the system segment at 0, a
chunk, or the question, which attends to everything before it). Keyed so,
requests with the same system prompt and leading documents share those
blocks whatever follows, and none is shared with a causal request (the
system marker of block 0). vLLM's `generate_block_hash_extra_keys` calls
`block_extra_keys`.

NOTE: the keys share one flat tuple with strings a client chooses (the
cache_salt, a LoRA name) and with (identifier, offset) multimodal pairs.
Each key is a 3-tuple, which no string and no pair equals, in Python or
serialised (pickle, CBOR): a salt spelled like a key shares nothing.
"""

from bisect import bisect_left
from itertools import accumulate

# (tag, offset of a segment start in the block, kind of segment starting there).
ChunkSegmentKey = tuple[str, int, str]
_TAG = "chunk-segment"

# The last (layout, block length) asked for with its keys by block start,
# holding the layout so that its identity is never reused. NOTE: vLLM asks
# once per block with the request's own layout tuple; a cache keyed by the
# tuple's value would hash all of it (one int per segment) on every block.
_last: tuple[tuple[int, ...], int, dict[int, tuple[ChunkSegmentKey, ...]]] | None = None


def _kind(index: int, last: int) -> str:
    return "s" if index == 0 else "q" if index == last else "c"


def _keys_by_block(
    layout: tuple[int, ...], length: int
) -> dict[int, tuple[ChunkSegmentKey, ...]]:
    """Every aligned block of `length` tokens a segment starts in, with its
    keys (most blocks hold no start: one dict lookup answers them)."""
    global _last
    last = _last
    if last is not None and last[0] is layout and last[1] == length:
        return last[2]
    table: dict[int, list[ChunkSegmentKey]] = {}
    for i, position in enumerate(accumulate(layout[:-1], initial=0)):
        block = position - position % length
        table.setdefault(block, []).append(
            (_TAG, position - block, _kind(i, len(layout) - 1))
        )
    frozen = {block: tuple(keys) for block, keys in table.items()}
    _last = (layout, length, frozen)
    return frozen


def block_extra_keys(
    layout: tuple[int, ...], start: int, end: int
) -> list[ChunkSegmentKey]:
    """Keys of the block [start, end) of a prompt with segment token counts
    `layout`: one per segment start inside it, with its offset in the block
    and its kind (s: the system segment, c: a chunk, q: the question)."""
    length = end - start
    if length <= 0 or start % length:
        return _unaligned_block_keys(layout, start, end)
    keys = _keys_by_block(layout, length).get(start)
    return [] if keys is None else list(keys)


def _unaligned_block_keys(
    layout: tuple[int, ...], start: int, end: int
) -> list[ChunkSegmentKey]:
    # NOTE: vLLM's blocks are aligned (start = k * length); anything else is
    # read the plain way, by bisecting the segment starts.
    starts = list(accumulate(layout[:-1], initial=0))
    return [
        (_TAG, starts[i] - start, _kind(i, len(starts) - 1))
        for i in range(bisect_left(starts, start), len(starts))
        if starts[i] < end
    ]
