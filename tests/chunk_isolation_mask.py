# SPDX-License-Identifier: Apache-2.0
"""The chunk-isolation semantics, made executable (ARCHITECTURE.md sec. 3).

The engine never builds this mask: it realises isolation structurally, by
computing each chunk in its own child request. This module is the
*definition* the engine is tested against (a test oracle: it lives under
tests/, out of the wheel; the quality benchmarks import it from here too): one HF
forward over the extended sequence it builds must give the same outputs as the engine
with the chunk cache on.

Extended sequence: the final prompt with each chunk's private context
inserted right before it:
* `none`: no context;
* `sink`: one copy of the deployment's sink token (a constant, e.g. the
  tokenizer's BOS), at position start - 1;
* `system`: a copy of the system segment, at positions
  start - len(system) .. start - 1.
Copies take the positions just before their chunk (they may repeat
positions of the previous segment); real tokens keep their real positions.
Because RoPE attention depends only on distances, a chunk computed this way
equals the chunk computed at 0 / after its context in a child request.

Visibility (causal everywhere; `allowed[q, k]` True = q may attend k):
* system token: system tokens before it;
* chunk token and its private copy: earlier tokens of the same chunk group
  (copy + chunk), nothing else;
* question token (and every appended generated token): every earlier *real*
  token, never a private copy.

Recompute levers (`build_lever_sequence`; `recompute_tokens=K` of
`build_isolated_sequence` is the boundary lever, the first min(K, len(chunk))
tokens of every chunk, EPIC / LegoLink). Some tokens of each chunk are
recomputed inside the request; the rest keep the KV their chunk computed in
isolation. Roles of the extended tokens:
* RECOMPUTED (real): attends causally to every real token before it - the
  system, every token of every earlier chunk (recomputed or cached), its own
  chunk's earlier tokens - never to a private copy;
* CACHED (real): its KV is the isolated one, so it attends to its chunk's
  private context and to the *isolated* versions of its chunk's earlier
  tokens, nothing else: an earlier cached token is itself; an earlier
  recomputed token is its ISOLATED copy;
* ISOLATED (private copy of a recomputed token, same token id and position):
  visible only to its own chunk's later isolated copies and cached tokens,
  and it follows the CACHED rule itself;
* question / generated tokens: every real token before them (so recomputed
  tokens with their full-visibility KV, cached tokens with their isolated
  KV), never a private copy.
Order inside a chunk: context copy, isolated copies of its recomputed tokens
(ascending), then its real tokens; the isolated computation of a chunk runs
in chunk order (context, then token 0, 1, ...). With nothing recomputed
this is exactly the isolation mask above; with every token of every chunk
recomputed the real rows are plain causal attention (no private copy is
visible to any real token). Both are unit-tested.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from vllm.v1.core.chunk_structures import ChunkContextMode, ChunkedPrompt

# Group id of question / generated tokens: they see every real token.
_OPEN_GROUP = -1


@dataclass(frozen=True)
class IsolatedSequence:
    """Inputs of one reference forward (batch of one)."""

    # Extended token ids [T] (private copies included).
    token_ids: list[int]
    # Explicit position ids [T] (int64).
    position_ids: torch.Tensor
    # Boolean attention mask [1, 1, T, T]; True = may attend.
    allowed: torch.Tensor
    # Index of each extended token in the final sequence, -1 for copies [T].
    source_index: torch.Tensor

    def additive_mask(
        self, dtype: torch.dtype = torch.float32, window: int | None = None
    ) -> torch.Tensor:
        """[1, 1, T, T]: 0 where allowed, the dtype's min elsewhere (HF);
        `window`: the mask of a sliding-window layer (`windowed`)."""
        allowed = self.allowed if window is None else self.windowed(window)
        mask = torch.zeros(allowed.shape, dtype=dtype)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)

    def windowed(self, window: int) -> torch.Tensor:
        """The mask of a layer with a sliding window of `window` keys (issue 42,
        docs/design/sliding-window.md): `allowed` and, by position, the last
        `window` keys up to the query's own (pos_q - pos_k < window). Copies sit
        at the positions just before their chunk, so a chunk token sees the last
        `window` keys of its private context and chunk (what its child computes
        alone); a question token sees the last `window` real keys of the
        assembled sequence."""
        pos = self.position_ids
        near = (pos[:, None] - pos[None, :]) < window
        return self.allowed & near[None, None]

    @property
    def real_rows(self) -> torch.Tensor:
        """Extended indices of the real tokens, in final-sequence order."""
        return torch.nonzero(self.source_index >= 0).flatten()


def build_isolated_sequence(
    prompt: ChunkedPrompt,
    mode: ChunkContextMode,
    extra_token_ids: Sequence[int] = (),
    sink_token_id: int | None = None,
    *,
    recompute_tokens: int = 0,
) -> IsolatedSequence:
    """Extended sequence, positions and mask for `prompt` under `mode`.

    `extra_token_ids` (e.g. generated tokens) are appended after the
    question and follow the question's rule. `sink_token_id` is the
    deployment's sink (required in `sink` mode). `recompute_tokens` = K > 0
    gives the boundary-recompute reference: the first min(K, len(chunk))
    tokens of every chunk recomputed (module docstring); 0 = isolation.
    """
    if recompute_tokens < 0:
        raise ValueError(f"recompute_tokens must be >= 0, got {recompute_tokens}")
    if recompute_tokens > 0:
        return build_lever_sequence(
            prompt,
            mode,
            first_k(prompt, recompute_tokens),
            extra_token_ids,
            sink_token_id,
        ).seq
    mode = ChunkContextMode(mode)
    if mode == ChunkContextMode.SINK and sink_token_id is None:
        raise ValueError("the sink mode needs the deployment's sink token id")
    tokens: list[int] = []
    positions: list[int] = []
    groups: list[int] = []
    sources: list[int] = []

    def emit(ids: Sequence[int], start: int, group: int, real: bool) -> None:
        tokens.extend(ids)
        positions.extend(range(start, start + len(ids)))
        groups.extend([group] * len(ids))
        sources.extend(range(start, start + len(ids)) if real else [-1] * len(ids))

    system = prompt.system_span
    emit(prompt.segment_tokens(0), 0, 0, True)
    for index, span in enumerate(prompt.chunk_spans, start=1):
        if mode == ChunkContextMode.SINK:
            emit([sink_token_id], span.start - 1, index, False)
        elif mode == ChunkContextMode.SYSTEM:
            emit(prompt.segment_tokens(0), span.start - system.num_tokens, index, False)
        emit(prompt.segment_tokens(index), span.start, index, True)
    question = prompt.question_span
    emit(
        prompt.segment_tokens(len(prompt.spans) - 1), question.start, _OPEN_GROUP, True
    )
    emit(list(extra_token_ids), question.end, _OPEN_GROUP, True)

    group = torch.tensor(groups)
    source = torch.tensor(sources, dtype=torch.int64)
    size = len(tokens)
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    same_group = group[:, None] == group[None, :]
    open_query = (group == _OPEN_GROUP)[:, None] & (source >= 0)[None, :]
    allowed = causal & (same_group | open_query)
    return IsolatedSequence(
        token_ids=tokens,
        position_ids=torch.tensor(positions, dtype=torch.int64),
        allowed=allowed[None, None],
        source_index=source,
    )


# ------------------------------------------------------------------ levers


class Role(Enum):
    SYSTEM = "system"  # real, segment 0
    CONTEXT = "context"  # private copy of the chunk's context (sink / system)
    ISOLATED = "isolated"  # private isolated copy of a recomputed chunk token
    CACHED = "cached"  # real chunk token keeping its isolated KV
    RECOMPUTED = "recomputed"  # real chunk token recomputed with full visibility
    OPEN = "open"  # question / generated token


_PRIVATE = (Role.CONTEXT, Role.ISOLATED)


@dataclass(frozen=True)
class LeverSequence:
    """The reference inputs plus, per extended token, what it is (for the
    tests and for counting recomputed tokens)."""

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
    chunk-local indices (0-based) of chunk i's recomputed tokens (module
    docstring: recompute levers)."""
    mode = ChunkContextMode(mode)
    if mode == ChunkContextMode.SINK and sink_token_id is None:
        raise ValueError("the sink mode needs the deployment's sink token id")
    if len(recompute) != prompt.num_chunks:
        raise ValueError(
            f"{len(recompute)} recompute sets for {prompt.num_chunks} chunks"
        )
    tokens: list[int] = []
    positions: list[int] = []
    roles: list[Role] = []
    groups: list[int] = []  # chunk number for chunk-side tokens, 0 otherwise
    slots: list[int] = []  # order inside the chunk's isolated computation
    sources: list[int] = []

    def emit(tok: int, pos: int, role: Role, group: int, slot: int) -> None:
        tokens.append(tok)
        positions.append(pos)
        roles.append(role)
        groups.append(group)
        slots.append(slot)
        sources.append(-1 if role in _PRIVATE else pos)

    system = prompt.segment_tokens(0)
    for j, tok in enumerate(system):
        emit(tok, j, Role.SYSTEM, 0, j)
    for index, span in enumerate(prompt.chunk_spans, start=1):
        chosen = set(int(j) for j in recompute[index - 1])
        chunk = prompt.segment_tokens(index)
        if chosen and (min(chosen) < 0 or max(chosen) >= len(chunk)):
            raise ValueError(f"chunk {index}: recompute index out of range")
        context = (
            [sink_token_id]
            if mode == ChunkContextMode.SINK
            else list(system)
            if mode == ChunkContextMode.SYSTEM
            else []
        )
        for j, tok in enumerate(context):
            emit(
                tok,
                span.start - len(context) + j,
                Role.CONTEXT,
                index,
                j - len(context),
            )
        for j in sorted(chosen):
            emit(chunk[j], span.start + j, Role.ISOLATED, index, j)
        for j, tok in enumerate(chunk):
            role = Role.RECOMPUTED if j in chosen else Role.CACHED
            emit(tok, span.start + j, role, index, j)
    question = prompt.question_span
    for j, tok in enumerate(
        [*prompt.segment_tokens(len(prompt.spans) - 1), *extra_token_ids]
    ):
        emit(tok, question.start + j, Role.OPEN, 0, 0)

    allowed = _visibility(roles, groups, slots, positions)
    return LeverSequence(
        IsolatedSequence(
            token_ids=tokens,
            position_ids=torch.tensor(positions, dtype=torch.int64),
            allowed=allowed[None, None],
            source_index=torch.tensor(sources, dtype=torch.int64),
        ),
        tuple(roles),
    )


def _visibility(
    roles: list[Role], groups: list[int], slots: list[int], positions: list[int]
) -> torch.Tensor:
    """allowed[q, k] from the rules in the module docstring."""
    role = torch.tensor([list(Role).index(r) for r in roles])
    is_ = {r: role == list(Role).index(r) for r in Role}
    group = torch.tensor(groups)
    slot = torch.tensor(slots)
    pos = torch.tensor(positions)
    index = torch.arange(len(roles))
    real = is_[Role.SYSTEM] | is_[Role.CACHED] | is_[Role.RECOMPUTED] | is_[Role.OPEN]
    # Real tokens come in the order of the final sequence (positions are
    # unique among them); a query sees keys at or before its own index.
    causal = index[None, :] <= index[:, None]
    # System tokens: earlier system tokens. Recomputed and open tokens: every
    # earlier real token (for the system and recomputed ones, also causal).
    sees_all_real = is_[Role.RECOMPUTED] | is_[Role.OPEN]
    full = sees_all_real[:, None] & real[None, :] & (pos[None, :] <= pos[:, None])
    system = is_[Role.SYSTEM][:, None] & is_[Role.SYSTEM][None, :] & causal
    # Chunk-private computation: context copies, isolated copies and cached
    # tokens of one chunk see each other in slot order. A cached token never
    # sees the real recomputed token, only its isolated copy (what its KV was
    # computed with).
    member = is_[Role.CONTEXT] | is_[Role.ISOLATED] | is_[Role.CACHED]
    same_chunk = (group[:, None] == group[None, :]) & (group[:, None] > 0)
    private = (
        member[:, None]
        & member[None, :]
        & same_chunk
        & (slot[None, :] <= slot[:, None])
    )
    return full | system | private


def first_k(prompt: ChunkedPrompt, k: int) -> list[list[int]]:
    """Boundary recompute (EPIC / LegoLink): the first k tokens of every
    chunk (all of a chunk shorter than k)."""
    return [list(range(min(k, s.num_tokens))) for s in prompt.chunk_spans]
