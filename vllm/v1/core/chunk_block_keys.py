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


def block_extra_keys(layout: tuple[int, ...], start: int, end: int) -> list[ChunkSegmentKey]:
    """Keys of the block [start, end) of a prompt with segment token counts
    `layout`: one per segment start inside it, with its offset in the block
    and its kind (s: the system segment, c: a chunk, q: the question)."""
    # NOTE: memoised per layout: a request asks once per block, and a prompt
    # of 500 documents has as many starts.
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
