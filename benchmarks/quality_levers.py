# SPDX-License-Identifier: Apache-2.0
"""Recompute levers as reference inputs (issue 11, deliverable 2): no engine code.

A lever recomputes some chunk tokens inside the request (ARCHITECTURE.md sec. 3,
"Recompute levers"). Under that semantics a recomputed token is a *real* token that
attends causally to every real token before it (system, earlier chunks, earlier
tokens of its chunk), and later tokens - the question included - see it. The rest
of the chunk keeps its cached KV, which was computed after the chunk's *isolated*
versions of the recomputed tokens: in the reference those isolated versions are one
more private copy (like the sink or system copy), visible only to the rest of their
chunk, at the same positions.

This module builds that extended sequence + 4D mask with the conventions of
vllm.v1.core.chunk_isolation_mask.build_isolated_sequence (same token order, same
position rule for copies, same IsolatedSequence type, `source_index` -1 for copies),
so that recomputing nothing gives exactly that function's output and recomputing
every chunk token gives causal attention over the real tokens.

Also the token selections: the first K tokens of each chunk (EPIC / LegoLink), the
r% of chunk tokens whose layer-1 K/V deviates most between the isolated and the
full-causal forward (CacheBlend's criterion), and a random r% (a control: does the
choice matter, or only the count?).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm.v1.core.chunk_isolation_mask import IsolatedSequence
from vllm.v1.core.chunk_structures import ChunkContextMode, ChunkedPrompt

# A token's view: 0 = the system segment, i >= 1 = chunk i's isolated world (its
# private copies and its cached tokens), _OPEN = sees every earlier real token.
_OPEN = -1


@dataclass(frozen=True)
class Recompute:
    """Which tokens of each chunk are recomputed: offsets within the chunk."""

    # One sorted tuple of offsets per chunk, in chunk order.
    offsets: tuple[tuple[int, ...], ...]

    def num_tokens(self) -> int:
        return sum(len(o) for o in self.offsets)

    @staticmethod
    def none(prompt: ChunkedPrompt) -> Recompute:
        return Recompute(tuple(() for _ in prompt.chunk_spans))


def build_lever_sequence(
    prompt: ChunkedPrompt,
    mode: ChunkContextMode | str,
    recompute: Recompute,
    extra_token_ids: Sequence[int] = (),
    sink_token_id: int | None = None,
) -> IsolatedSequence:
    """Extended sequence, positions and mask for `prompt` under `mode` + `recompute`.

    Order per chunk: private context copy, then the chunk's tokens at their real
    positions (recomputed ones as isolated copies), then the recomputed tokens again
    as real tokens. The mask is built from (view, position, real) alone, so the order
    matters only for where rows sit; the question and `extra_token_ids` stay last.
    """
    mode = ChunkContextMode(mode)
    if mode == ChunkContextMode.SINK and sink_token_id is None:
        raise ValueError("the sink mode needs the deployment's sink token id")
    if len(recompute.offsets) != len(prompt.chunk_spans):
        raise ValueError("one offset tuple per chunk")
    tokens: list[int] = []
    positions: list[int] = []
    views: list[int] = []
    sources: list[int] = []

    def emit(ids: Sequence[int], pos: Sequence[int], view: int, real: bool) -> None:
        tokens.extend(ids)
        positions.extend(pos)
        views.extend([view] * len(ids))
        sources.extend(pos if real else [-1] * len(ids))

    system = prompt.segment_tokens(0)
    emit(system, range(len(system)), 0, True)
    for index, span in enumerate(prompt.chunk_spans, start=1):
        if mode == ChunkContextMode.SINK:
            emit([sink_token_id], [span.start - 1], index, False)
        elif mode == ChunkContextMode.SYSTEM:
            emit(system, range(span.start - len(system), span.start), index, False)
        chunk = prompt.segment_tokens(index)
        chosen = set(recompute.offsets[index - 1])
        if any(o < 0 or o >= len(chunk) for o in chosen):
            raise ValueError(f"chunk {index}: offsets outside 0..{len(chunk) - 1}")
        for off, tok in enumerate(chunk):
            # A recomputed token's isolated version stays as a private copy: the
            # cached rest of the chunk was computed after it.
            emit([tok], [span.start + off], index, off not in chosen)
        for off in sorted(chosen):
            emit([chunk[off]], [span.start + off], _OPEN, True)
    question = prompt.question_span
    emit(prompt.segment_tokens(len(prompt.spans) - 1), range(question.start, question.end),
         _OPEN, True)
    emit(list(extra_token_ids), range(question.end, question.end + len(extra_token_ids)),
         _OPEN, True)

    view = torch.tensor(views)
    pos = torch.tensor(positions, dtype=torch.int64)
    source = torch.tensor(sources, dtype=torch.int64)
    # Causal by real position (every view holds at most one token per position).
    causal = pos[None, :] <= pos[:, None]
    same_view = (view[:, None] == view[None, :]) & (view >= 0)[:, None]
    open_query = (view == _OPEN)[:, None] & (source >= 0)[None, :]
    allowed = causal & (same_view | open_query)
    return IsolatedSequence(token_ids=tokens, position_ids=pos, allowed=allowed[None, None],
                            source_index=source)


# ------------------------------------------------------------------ selections


def first_k(prompt: ChunkedPrompt, k: int) -> Recompute:
    """EPIC / LegoLink: the first `k` tokens of every chunk."""
    return Recompute(tuple(tuple(range(min(k, s.num_tokens))) for s in prompt.chunk_spans))


def _chunk_rows(prompt: ChunkedPrompt) -> list[tuple[int, int]]:
    """(chunk index from 0, offset) of every chunk token, in prompt order."""
    return [(c, o) for c, s in enumerate(prompt.chunk_spans) for o in range(s.num_tokens)]


def _from_rows(prompt: ChunkedPrompt, rows: Sequence[tuple[int, int]]) -> Recompute:
    per = [[] for _ in prompt.chunk_spans]
    for c, o in rows:
        per[c].append(o)
    return Recompute(tuple(tuple(sorted(o)) for o in per))


def _count(prompt: ChunkedPrompt, fraction: float) -> int:
    total = sum(s.num_tokens for s in prompt.chunk_spans)
    return round(total * fraction)


def top_deviation(prompt: ChunkedPrompt, deviation: torch.Tensor, fraction: float) -> Recompute:
    """CacheBlend: the `fraction` of chunk tokens with the largest deviation.

    `deviation` holds one value per real token of the prompt (final-sequence order);
    the selection is global over all chunks, as CacheBlend's per-request top-r%."""
    rows = _chunk_rows(prompt)
    starts = [s.start for s in prompt.chunk_spans]
    scores = torch.tensor([float(deviation[starts[c] + o]) for c, o in rows])
    order = torch.argsort(scores, descending=True, stable=True)[: _count(prompt, fraction)]
    return _from_rows(prompt, [rows[i] for i in order.tolist()])


def random_fraction(prompt: ChunkedPrompt, fraction: float, seed: int) -> Recompute:
    """A seeded random `fraction` of chunk tokens (control for top_deviation)."""
    rows = _chunk_rows(prompt)
    rng = random.Random(f"lever-{seed}")
    return _from_rows(prompt, rng.sample(rows, _count(prompt, fraction)))


def all_tokens(prompt: ChunkedPrompt) -> Recompute:
    return _from_rows(prompt, _chunk_rows(prompt))
