# SPDX-License-Identifier: Apache-2.0
"""Token ids of a QA item, shared by the engine runs and the HF reference so that
both score exactly the same sequence.

Each segment is tokenized on its own (special tokens on the first only), as the
fork's renderer does; the gold continuation is " " + answer tokenized on its own
and appended after the question (how generated tokens follow a prompt)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.chunk_structures import ChunkedPrompt

from .dataset import Question


@dataclass(frozen=True)
class EncodedQuestion:
    question: Question
    # Per-segment token ids: system, documents..., question.
    segments: tuple[tuple[int, ...], ...]
    # Token ids of " " + answer.
    gold: tuple[int, ...]

    @property
    def prompt(self) -> ChunkedPrompt:
        return ChunkedPrompt.from_lengths([t for s in self.segments for t in s],
                                          [len(s) for s in self.segments])

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def num_chunk_tokens(self) -> int:
        return sum(len(s) for s in self.segments[1:-1])

    def plain_ids(self, extra: tuple[int, ...] = ()) -> list[int]:
        """The final sequence (no separators): what stock vLLM gets."""
        return [t for s in self.segments for t in s] + list(extra)

    def chunked_ids(self, separator: list[int], extra: tuple[int, ...] = ()) -> list[int]:
        """Segments joined by the separator's ids (the fork splits token-id prompts
        there); `extra` extends the question segment."""
        out: list[int] = []
        for i, seg in enumerate(self.segments):
            out += (separator if i else []) + list(seg)
        return out + list(extra)


def encode(tokenizer, question: Question) -> EncodedQuestion:
    segments = tuple(tuple(tokenizer.encode(text, add_special_tokens=(i == 0)))
                     for i, text in enumerate(question.segments))
    gold = tuple(tokenizer.encode(" " + question.answer, add_special_tokens=False))
    return EncodedQuestion(question, segments, gold)


def ends_word(text: str) -> bool:
    """True when `text` (what follows the answer) does not continue its last word:
    " 4821." and " 4821\\n" are exact matches of 4821, " 48215" is not."""
    return not text or not (text[0].isalnum() or text[0] in "'-")
