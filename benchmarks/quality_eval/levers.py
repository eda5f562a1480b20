# SPDX-License-Identifier: Apache-2.0
"""Recompute levers as extended sequences + 4D masks (ARCHITECTURE.md sec. 3, levers).

A lever recomputes some tokens of each chunk inside the request; the rest of the
chunk keeps its cached KV. The reference is one forward over an extended sequence:

* a recomputed token is a *real* token that attends causally to every real token
  before it (system, every earlier chunk, its own chunk's earlier tokens), never to
  a private copy;
* a cached token is a real token whose KV is the one the chunk computed in
  isolation: it attends to its chunk's private context (sink / system copy) and to
  the *isolated* versions of its chunk's earlier tokens. For an earlier cached token
  that is the token itself; for an earlier recomputed token it is one more private
  copy (at the same position), visible only to the rest of its chunk;
* question and generated tokens attend to every real token before them.

Order inside a chunk: context copy, isolated copies of its recomputed tokens, then
its real tokens. With nothing recomputed this is exactly
`vllm.v1.core.chunk_isolation_mask.build_isolated_sequence` (unit-tested), so the
levers and the modes share one definition. The module lives in benchmarks/ (not in
the engine's overlay) until a lever is built in the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from vllm.v1.core.chunk_isolation_mask import IsolatedSequence
from vllm.v1.core.chunk_structures import ChunkContextMode, ChunkedPrompt


class Role(Enum):
    SYSTEM = "system"      # real, segment 0
    CONTEXT = "context"    # private copy of the chunk's context (sink / system)
    ISOLATED = "isolated"  # private isolated copy of a recomputed chunk token
    CACHED = "cached"      # real chunk token keeping its isolated KV
    RECOMPUTED = "recomputed"  # real chunk token recomputed with full visibility
    OPEN = "open"          # question / generated token


_PRIVATE = (Role.CONTEXT, Role.ISOLATED)


@dataclass(frozen=True)
class LeverSequence:
    """The reference inputs plus, per extended token, what it is (for the tests and
    for counting recomputed tokens)."""

    seq: IsolatedSequence
    roles: tuple[Role, ...]

    @property
    def num_recomputed(self) -> int:
        return sum(r == Role.RECOMPUTED for r in self.roles)


def build_lever_sequence(
    prompt: ChunkedPrompt,
    mode: ChunkContextMode | str,
    recompute: Sequence[Sequence[int]],
    extra_token_ids: Sequence[int] = (),
    sink_token_id: int | None = None,
) -> LeverSequence:
    """Extended sequence for `prompt` under `mode` with `recompute[i]` = the
    chunk-local indices (0-based) of chunk i's recomputed tokens."""
    mode = ChunkContextMode(mode)
    if mode == ChunkContextMode.SINK and sink_token_id is None:
        raise ValueError("the sink mode needs the deployment's sink token id")
    if len(recompute) != prompt.num_chunks:
        raise ValueError(f"{len(recompute)} recompute sets for {prompt.num_chunks} chunks")
    tokens: list[int] = []
    positions: list[int] = []
    roles: list[Role] = []
    groups: list[int] = []  # chunk number for chunk-side tokens, 0 otherwise
    slots: list[int] = []   # order inside the chunk's isolated computation
    sources: list[int] = []

    def emit(tok: int, pos: int, role: Role, group: int, slot: int) -> None:
        tokens.append(tok)
        positions.append(pos)
        roles.append(role)
        groups.append(group)
        slots.append(slot)
        sources.append(-1 if role in _PRIVATE else pos)

    for j, tok in enumerate(prompt.segment_tokens(0)):
        emit(tok, j, Role.SYSTEM, 0, j)
    system = prompt.segment_tokens(0)
    for index, span in enumerate(prompt.chunk_spans, start=1):
        chosen = set(int(j) for j in recompute[index - 1])
        chunk = prompt.segment_tokens(index)
        if chosen and (min(chosen) < 0 or max(chosen) >= len(chunk)):
            raise ValueError(f"chunk {index}: recompute index out of range")
        context = ([sink_token_id] if mode == ChunkContextMode.SINK else
                   list(system) if mode == ChunkContextMode.SYSTEM else [])
        for j, tok in enumerate(context):
            emit(tok, span.start - len(context) + j, Role.CONTEXT, index, j - len(context))
        for j in sorted(chosen):
            emit(chunk[j], span.start + j, Role.ISOLATED, index, j)
        for j, tok in enumerate(chunk):
            role = Role.RECOMPUTED if j in chosen else Role.CACHED
            emit(tok, span.start + j, role, index, j)
    question = prompt.question_span
    for j, tok in enumerate([*prompt.segment_tokens(len(prompt.spans) - 1),
                             *extra_token_ids]):
        emit(tok, question.start + j, Role.OPEN, 0, 0)

    allowed = _visibility(roles, groups, slots, positions)
    return LeverSequence(
        IsolatedSequence(token_ids=tokens,
                         position_ids=torch.tensor(positions, dtype=torch.int64),
                         allowed=allowed[None, None],
                         source_index=torch.tensor(sources, dtype=torch.int64)),
        tuple(roles))


def _visibility(roles: list[Role], groups: list[int], slots: list[int],
                positions: list[int]) -> torch.Tensor:
    """allowed[q, k] from the rules in the module docstring."""
    role = torch.tensor([list(Role).index(r) for r in roles])
    is_ = {r: role == list(Role).index(r) for r in Role}
    group = torch.tensor(groups)
    slot = torch.tensor(slots)
    pos = torch.tensor(positions)
    size = len(roles)
    index = torch.arange(size)
    real = is_[Role.SYSTEM] | is_[Role.CACHED] | is_[Role.RECOMPUTED] | is_[Role.OPEN]
    # Real tokens in the order of the final sequence (positions are unique among
    # them); a query sees keys at or before its own index - this is causal order.
    causal = index[None, :] <= index[:, None]
    # System tokens: earlier system tokens. Recomputed and open tokens: every earlier
    # real token (which, for the system and recomputed tokens, is also causal).
    sees_all_real = is_[Role.RECOMPUTED] | is_[Role.OPEN]
    full = sees_all_real[:, None] & real[None, :] & (pos[None, :] <= pos[:, None])
    system = is_[Role.SYSTEM][:, None] & is_[Role.SYSTEM][None, :] & causal
    # Chunk-private computation: context copies, isolated copies and cached tokens
    # of one chunk see each other in slot order. A cached token never sees the real
    # recomputed token, only its isolated copy (what its KV was computed with).
    member = is_[Role.CONTEXT] | is_[Role.ISOLATED] | is_[Role.CACHED]
    same_chunk = (group[:, None] == group[None, :]) & (group[:, None] > 0)
    private = (member[:, None] & member[None, :] & same_chunk
               & (slot[None, :] <= slot[:, None]))
    return full | system | private


def first_k(prompt: ChunkedPrompt, k: int) -> list[list[int]]:
    """Boundary recompute (EPIC / LegoLink): the first k tokens of every chunk."""
    return [list(range(min(k, s.num_tokens))) for s in prompt.chunk_spans]


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
