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
"""

from bisect import bisect_left
from functools import lru_cache
from itertools import accumulate


@lru_cache(maxsize=4096)
def _starts(layout: tuple[int, ...]) -> tuple[int, ...]:
    """Start position of every segment (system, chunks..., question)."""
    return (0, *accumulate(layout[:-1]))


def block_extra_keys(layout: tuple[int, ...], start: int, end: int) -> list[str]:
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
        keys.append(f"chunk-segment:{position - start}:{kind}")
    return keys
