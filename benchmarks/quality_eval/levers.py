# SPDX-License-Identifier: Apache-2.0
"""Recompute levers for the quality evaluation (ARCHITECTURE.md sec. 3, levers).

The general lever reference - `build_lever_sequence` (an extended sequence + 4D
mask in which some tokens of each chunk are recomputed with full visibility and
the rest keep their isolated KV), its `Role`s, and the boundary selection
`first_k` (EPIC / LegoLink) - is part of the engine's isolation reference,
`tests/chunk_isolation_mask.py` (its docstring defines the semantics); it is
re-exported here. This module adds the benchmark-only levers: the selection
`top_fraction` (CacheBlend), `question_aware` (the question's attention, issue 33)
and `context_scale_bias` (APE's scaling factor).
"""

from __future__ import annotations

import math

import torch

from tests.chunk_isolation_mask import (
    IsolatedSequence,
    LeverSequence,
    Role,
    build_lever_sequence,
    first_k,
)
from vllm.v1.core.chunk_structures import ChunkedPrompt

__all__ = ["LeverSequence", "Role", "build_lever_sequence", "context_scale_bias", "first_k",
           "question_aware", "question_chunks", "top_fraction"]


def context_scale_bias(prompt: ChunkedPrompt, seq: IsolatedSequence,
                       scale: float) -> torch.Tensor:
    """APE's scaling factor (Yang et al. 2025, "APE: faster and longer context-augmented
    generation via adaptive parallel encoding"), training-free, as an additive logit
    bias [T, T] on top of a mode's extended sequence: log(scale) on the logits of the
    question and generated tokens toward the real chunk tokens, i.e. their attention
    weights to the documents are multiplied by `scale` before normalisation. Nothing is
    recomputed. (APE's other half, a temperature on those logits, is multiplicative
    and not expressible as a bias; it is not measured.)"""
    source = seq.source_index
    chunks_start = prompt.system_span.end
    question_start = prompt.question_span.start
    rows = source >= question_start
    cols = (source >= chunks_start) & (source < question_start)
    bias = torch.zeros(len(source), len(source))
    bias[rows[:, None] & cols[None, :]] = math.log(scale)
    return bias


def top_fraction(prompt: ChunkedPrompt, scores: torch.Tensor, fraction: float) -> list[list[int]]:
    """Selective recompute (CacheBlend): the `fraction` of all chunk tokens with the
    highest `scores` (one score per final-sequence token; only chunk tokens compete),
    chosen over all chunks together as CacheBlend does."""
    return _top_count(prompt, scores, round(fraction * prompt_chunk_tokens(prompt)))


def question_aware(prompt: ChunkedPrompt, attention: torch.Tensor, fraction: float,
                   first: int = 0) -> list[list[int]]:
    """Question-aware recompute (issue 33; the selection of ProphetKV / InfoFlow-style
    methods): the `fraction` of all chunk tokens that the question attends to most.
    `attention`: one score per final-sequence token (the question's attention
    probabilities, `ReferenceScorer.question_attention`); only chunk tokens compete,
    over all chunks together. `first` > 0 also recomputes the first `first` tokens of
    every chunk, *inside* the budget: they are taken first and the attention ranking
    fills the rest (the budget grows to the forced tokens when they alone exceed it)."""
    forced = first_k(prompt, first) if first > 0 else [[] for _ in prompt.chunk_spans]
    boosted = attention.detach().to(torch.float64).clone()
    for span, local in zip(prompt.chunk_spans, forced):
        boosted[[span.start + j for j in local]] = math.inf
    count = max(round(fraction * prompt_chunk_tokens(prompt)), sum(map(len, forced)))
    return _top_count(prompt, boosted, count)


def question_chunks(prompt: ChunkedPrompt, attention: torch.Tensor,
                    fraction: float) -> list[list[int]]:
    """Question-aware boundary recompute: the chunks ranked by the question's total
    attention to their tokens, and the budget (`fraction` of all chunk tokens) spent on
    their first tokens in that order - the most attended chunk's head first, all of it
    before the next chunk gets any. The question picks the documents, position inside
    a document follows the boundary lever (whose tokens carry the document's subject)."""
    mass = [float(attention[s.start:s.end].sum()) for s in prompt.chunk_spans]
    order = sorted(range(len(mass)), key=lambda i: -mass[i])  # stable: ties by position
    left = round(fraction * prompt_chunk_tokens(prompt))
    out: list[list[int]] = [[] for _ in prompt.chunk_spans]
    for i in order:
        take = min(left, prompt.chunk_spans[i].num_tokens)
        out[i] = list(range(take))
        left -= take
    return out


def prompt_chunk_tokens(prompt: ChunkedPrompt) -> int:
    return sum(s.num_tokens for s in prompt.chunk_spans)


def _top_count(prompt: ChunkedPrompt, scores: torch.Tensor, count: int) -> list[list[int]]:
    """Chunk-local indices, per chunk, of the `count` chunk tokens with the highest
    scores (ties: the earlier token)."""
    chunk_index = [i for s in prompt.chunk_spans for i in range(s.start, s.end)]
    picked: set[int] = set()
    if count > 0:
        values = scores[torch.tensor(chunk_index)]
        order = torch.argsort(values, descending=True, stable=True)[:count]
        picked = {chunk_index[int(i)] for i in order}
    return [[i - s.start for i in range(s.start, s.end) if i in picked]
            for s in prompt.chunk_spans]
