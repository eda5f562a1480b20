# SPDX-License-Identifier: Apache-2.0
"""Recompute levers for the quality evaluation (ARCHITECTURE.md sec. 3, levers).

The general lever reference - `build_lever_sequence` (an extended sequence + 4D
mask in which some tokens of each chunk are recomputed with full visibility and
the rest keep their isolated KV), its `Role`s, and the boundary selection
`first_k` (EPIC / LegoLink) - is part of the engine's isolation reference,
`vllm.v1.core.chunk_isolation_mask` (its docstring defines the semantics); it is
re-exported here. This module adds only the benchmark-only selection
`top_fraction` (CacheBlend).
"""

from __future__ import annotations

import torch

from vllm.v1.core.chunk_isolation_mask import (
    LeverSequence,
    Role,
    build_lever_sequence,
    first_k,
)
from vllm.v1.core.chunk_structures import ChunkedPrompt

__all__ = ["LeverSequence", "Role", "build_lever_sequence", "first_k", "top_fraction"]


def top_fraction(prompt: ChunkedPrompt, scores: torch.Tensor, fraction: float) -> list[list[int]]:
    """Selective recompute (CacheBlend): the `fraction` of all chunk tokens with the
    highest `scores` (one score per final-sequence token; only chunk tokens compete),
    chosen over all chunks together as CacheBlend does."""
    chunk_index = [i for s in prompt.chunk_spans for i in range(s.start, s.end)]
    count = round(fraction * len(chunk_index))
    picked: set[int] = set()
    if count > 0:
        values = scores[torch.tensor(chunk_index)]
        order = torch.argsort(values, descending=True, stable=True)[:count]
        picked = {chunk_index[int(i)] for i in order}
    return [[i - s.start for i in range(s.start, s.end) if i in picked]
            for s in prompt.chunk_spans]
