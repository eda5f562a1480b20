# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Split a prompt into chunk-cache segments: system ## chunk ## ... ## question.

`parse_text` splits a string on the separator and tokenizes every segment on
its own (so a document gets the same ids wherever it appears); `parse_token_ids`
splits token ids where the separator's ids occur. The separators are dropped;
a prompt without one is not chunked (None). Whitespace policy and limits:
docs/design/chunk-parsing.md.
"""

from collections.abc import Sequence
from itertools import chain
from typing import Protocol, TypeAlias

import numpy as np
import torch

from vllm.v1.core.chunk_structures import ChunkedPrompt


class SegmentTokenizer(Protocol):
    """The part of a (HF or vLLM) tokenizer the parser uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


TokenIdsLike: TypeAlias = Sequence[int] | np.ndarray | torch.Tensor


class ChunkedPromptParser:
    """Splits prompts on a separator (docs/design/chunk-parsing.md)."""

    def __init__(self, separator: str, max_chunks: int, max_chunk_tokens: int):
        if not separator or separator.strip() != separator:
            # Stripping the whitespace next to a separator would eat part of it.
            raise ValueError(
                f"--chunk-separator {separator!r} must be non-empty and have "
                "no leading or trailing whitespace"
            )
        if max_chunks < 0 or max_chunk_tokens < 1:
            raise ValueError(
                "--max-chunks must be >= 0 and --max-chunk-tokens >= 1, not "
                f"{max_chunks} and {max_chunk_tokens}"
            )
        self.separator = separator
        self.max_chunks = max_chunks
        self.max_chunk_tokens = max_chunk_tokens

    def split_text(self, prompt: str) -> list[str] | None:
        """Segment strings after the whitespace policy; None if unchunked."""
        parts = prompt.split(self.separator)
        if len(parts) < 2:
            return None
        self.check_num_chunks(len(parts) - 2)
        chunks = (part.strip() for part in parts[1:-1])
        return [parts[0].rstrip(), *chunks, parts[-1].lstrip()]

    def parse_text(
        self, prompt: str, tokenizer: SegmentTokenizer
    ) -> ChunkedPrompt | None:
        """Split `prompt` and tokenize each segment on its own."""
        segments = self.split_text(prompt)
        if segments is None:
            return None
        token_lists = [
            tokenizer.encode(text, add_special_tokens=(index == 0))
            for index, text in enumerate(segments)
        ]
        return self.build(token_lists)

    def separator_token_ids(self, tokenizer: SegmentTokenizer) -> list[int]:
        """The separator's ids as the tokenizer encodes it alone (BPE may
        encode ' ##' otherwise: token-id prompts must hold exactly these)."""
        ids = list(tokenizer.encode(self.separator, add_special_tokens=False))
        if not ids:
            raise ValueError(
                f"--chunk-separator {self.separator!r} encodes to no tokens"
            )
        return ids

    def parse_token_ids(
        self, token_ids: TokenIdsLike, separator_token_ids: Sequence[int]
    ) -> ChunkedPrompt | None:
        """Split a token-id prompt where `separator_token_ids` occurs."""
        if len(separator_token_ids) == 0:
            raise ValueError("separator_token_ids must not be empty")
        tokens = _as_int64_array(token_ids)
        starts = find_separator_starts(tokens, np.asarray(separator_token_ids))
        if starts.size == 0:
            return None
        self.check_num_chunks(starts.size - 1)
        sep_len = len(separator_token_ids)
        # Segment i spans [bounds_start[i], bounds_end[i]) in the input.
        bounds_start = np.concatenate(([0], starts + sep_len))
        bounds_end = np.concatenate((starts, [tokens.size]))
        lengths = bounds_end - bounds_start
        self._check_lengths(lengths.tolist())
        keep = np.ones(tokens.size, dtype=bool)
        for start in starts.tolist():
            keep[start : start + sep_len] = False
        return ChunkedPrompt.from_lengths(tokens[keep].tolist(), lengths.tolist())

    def build(self, token_lists: list[list[int]]) -> ChunkedPrompt:
        """The prompt of already tokenized segments (limits checked)."""
        lengths = [len(ids) for ids in token_lists]
        self._check_lengths(lengths)
        # NOTE: chain, not a comprehension: no Python bytecode per token.
        flat = list(chain.from_iterable(token_lists))
        return ChunkedPrompt.from_lengths(flat, lengths)

    def check_num_chunks(self, num_chunks: int) -> None:
        if num_chunks > self.max_chunks:
            raise ValueError(
                f"chunked prompt has {num_chunks} chunks (segments 1.."
                f"{num_chunks}), more than --max-chunks {self.max_chunks}"
            )

    def _check_lengths(self, lengths: list[int]) -> None:
        last = len(lengths) - 1
        for index, length in enumerate(lengths):
            if length == 0:
                raise ValueError(
                    f"chunked prompt segment {index} is empty (after removing "
                    "the separator and adjacent whitespace); every segment "
                    "needs at least 1 token"
                )
            if index != last and length > self.max_chunk_tokens:
                raise ValueError(
                    f"chunked prompt segment {index} has {length} tokens, "
                    f"more than --max-chunk-tokens {self.max_chunk_tokens}"
                )


def find_separator_starts(tokens: np.ndarray, separator: np.ndarray) -> np.ndarray:
    """Start indices of leftmost non-overlapping occurrences of `separator`
    (`str.split`'s rule): one vectorised comparison of all windows per
    separator token; only the candidates are walked, to drop overlaps."""
    n, m = tokens.size, separator.size
    if n < m:
        return np.empty(0, dtype=np.int64)
    num_windows = n - m + 1
    match = tokens[:num_windows] == separator[0]
    for offset in range(1, m):
        match &= tokens[offset : offset + num_windows] == separator[offset]
    candidates = np.flatnonzero(match)
    if m == 1 or candidates.size < 2:
        return candidates
    if not (np.diff(candidates) < m).any():
        return candidates
    kept: list[int] = []
    next_free = 0
    for start in candidates.tolist():
        if start >= next_free:
            kept.append(start)
            next_free = start + m
    return np.asarray(kept, dtype=np.int64)


def _as_int64_array(token_ids: TokenIdsLike) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.detach().to("cpu", torch.int64).reshape(-1).numpy()
    return np.asarray(token_ids, dtype=np.int64).reshape(-1)
