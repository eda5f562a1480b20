# SPDX-License-Identifier: Apache-2.0
"""The chunk-isolation semantics, made executable (ARCHITECTURE.md sec. 3).

The engine never builds this mask: it realises isolation structurally, by
computing each chunk in its own child request. This module is the
*definition* the engine is tested against: one HF forward over the
extended sequence it builds must give the same outputs as the engine with
the chunk cache on.

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
"""

from collections.abc import Sequence
from dataclasses import dataclass

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

    def additive_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[1, 1, T, T]: 0 where allowed, the dtype's min elsewhere (HF)."""
        mask = torch.zeros(self.allowed.shape, dtype=dtype)
        return mask.masked_fill(~self.allowed, torch.finfo(dtype).min)

    @property
    def real_rows(self) -> torch.Tensor:
        """Extended indices of the real tokens, in final-sequence order."""
        return torch.nonzero(self.source_index >= 0).flatten()


def build_isolated_sequence(
    prompt: ChunkedPrompt,
    mode: ChunkContextMode,
    extra_token_ids: Sequence[int] = (),
    sink_token_id: int | None = None,
) -> IsolatedSequence:
    """Extended sequence, positions and mask for `prompt` under `mode`.

    `extra_token_ids` (e.g. generated tokens) are appended after the
    question and follow the question's rule. `sink_token_id` is the
    deployment's sink (required in `sink` mode).
    """
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
            emit(prompt.segment_tokens(0), span.start - system.num_tokens,
                 index, False)
        emit(prompt.segment_tokens(index), span.start, index, True)
    question = prompt.question_span
    emit(prompt.segment_tokens(len(prompt.spans) - 1), question.start,
         _OPEN_GROUP, True)
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
