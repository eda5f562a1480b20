# SPDX-License-Identifier: Apache-2.0
"""The prefix-cache extra keys of a chunked prompt's paged blocks.

A chunked prompt's KV follows the chunk-isolation semantics, so vLLM's
prefix cache may share one of its blocks only with a block whose KV is the
same. vLLM chains block hashes (each covers its parent's), so a block is
fully identified by its tokens, its parent and what the semantics make of
tokens *inside* it: the segment boundaries that fall in it, and what starts
there (the system segment at 0, a chunk, or the question, which attends to
everything before it). Keying each block by those boundaries, as vLLM keys
multimodal placeholders by the ones in the block, lets requests with the
same system prompt and leading documents share those blocks whatever comes
after (another question, a follow-up in a conversation), and never shares a
block with a causal request (the system marker of block 0) or with a block
whose tokens a boundary of another kind splits.

Engine-free: patch 0002 calls `block_extra_keys` from vLLM's
`generate_block_hash_extra_keys`.

NOTE: the keys share one flat tuple with strings a client chooses (the
cache_salt, a LoRA name) and with multimodal keys, (identifier, offset) pairs
whose identifier a client may choose too. Each key is therefore a 3-tuple,
which no string and no pair equals, in Python or serialised (pickle and CBOR,
vLLM's --prefix-caching-hash-algo choices): a salt spelled like a key shares
nothing with a chunked prompt (issue 30, finding 6).
"""

from bisect import bisect_left
from functools import lru_cache
from itertools import accumulate

# (tag, offset of a segment start in the block, kind of segment starting there).
ChunkSegmentKey = tuple[str, int, str]
_TAG = "chunk-segment"


@lru_cache(maxsize=4096)
def _starts_of(layout: tuple[int, ...]) -> tuple[int, ...]:
    return (0, *accumulate(layout[:-1]))


# The last layout asked for and its starts, held (so its id is never reused).
_last: tuple[tuple[int, ...], tuple[int, ...]] | None = None


def _starts(layout: tuple[int, ...]) -> tuple[int, ...]:
    """Start position of every segment (system, chunks..., question).

    NOTE (issue 52): vLLM asks once per block with the request's own layout
    tuple, and an lru_cache lookup hashes the whole tuple (one element per
    segment) every time: at 128k tokens as 256 documents that was 1.7 ms of
    the request's 4.5 ms of block hashing. A tuple never changes, so the
    same object gives the same starts without hashing it again.
    """
    global _last
    last = _last
    if last is not None and last[0] is layout:
        return last[1]
    starts = _starts_of(layout)
    _last = (layout, starts)
    return starts


def _plain_block_keys(
    layout: tuple[int, ...],
    start: int,
    end: int,
) -> list[ChunkSegmentKey]:
    """The keys of [start, end), found by bisecting the layout's starts."""
    starts = _starts(layout)
    last = len(starts) - 1
    keys = []
    for i in range(bisect_left(starts, start), len(starts)):
        position = starts[i]
        if position >= end:
            break
        kind = "s" if i == 0 else "q" if i == last else "c"
        keys.append((_TAG, position - start, kind))
    return keys


# The last (layout, block length) asked for and its keys by block start: only
# the blocks a segment starts in are there.
_last_blocks: (
    tuple[tuple[int, ...], int, dict[int, tuple[ChunkSegmentKey, ...]]] | None
) = None


def _keys_by_block(
    layout: tuple[int, ...], length: int
) -> dict[int, tuple[ChunkSegmentKey, ...]]:
    """Every aligned block of `length` tokens that a segment starts in, with
    its keys. NOTE (issue 60): vLLM asks once per block of the prompt (1,022
    blocks of 32 tokens at 32k) and most blocks hold no start; one pass over
    the segments here makes each block's question one dict lookup instead of
    a bisect and a loop."""
    global _last_blocks
    last = _last_blocks
    if last is not None and last[0] is layout and last[1] == length:
        return last[2]
    starts = _starts(layout)
    final = len(starts) - 1
    table: dict[int, list[ChunkSegmentKey]] = {}
    for i, position in enumerate(starts):
        block = position - position % length
        kind = "s" if i == 0 else "q" if i == final else "c"
        table.setdefault(block, []).append((_TAG, position - block, kind))
    frozen = {block: tuple(keys) for block, keys in table.items()}
    _last_blocks = (layout, length, frozen)
    return frozen


def block_extra_keys(
    layout: tuple[int, ...], start: int, end: int
) -> list[ChunkSegmentKey]:
    """Keys of the block [start, end) of a prompt with segment token counts
    `layout`: one per segment start inside it, with its offset in the block
    and its kind (s: the system segment, c: a chunk, q: the question)."""
    length = end - start
    if length <= 0 or start % length:
        # NOTE: vLLM's blocks are aligned (start = k * length); anything else
        # is read the plain way.
        return _plain_block_keys(layout, start, end)
    keys = _keys_by_block(layout, length).get(start)
    return [] if keys is None else list(keys)
