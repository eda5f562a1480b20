# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which prompt tokens of a chunked request are loaded and which computed.

Without boundary recompute a chunked request loads one prefix (system and
every chunk) and computes the question. With `--chunk-recompute-tokens K`
the first K tokens of every chunk are computed inside the request too, so
the prompt alternates:

    [system: loaded][c1[:K] computed][c1[K:] loaded][c2[:K] computed]...[question]

Every stretch is taken in one step where the model runner takes query runs
(`steps_from`), else one per step; why: docs/design/boundary-recompute.md,
"Why one step". A pure function of the layout and K, the same after a
preemption too.
"""

from dataclasses import dataclass

from vllm.v1.core.chunk_structures import ChunkedPrompt, SegmentSpan


@dataclass(frozen=True)
class PrefillStep:
    """What to do at one prompt position (the request's num_computed_tokens)."""

    # Tokens from that position on that are loaded from the pool.
    num_loaded: int
    # Tokens to compute right after them before the next loaded stretch
    # (the rest of the prompt after the last one; always >= 1).
    max_computed: int


@dataclass(frozen=True)
class PrefillPlan:
    """The loaded stretches of a chunked prompt; the rest is computed."""

    # Loaded stretches in prompt order, disjoint, non-adjacent, all before
    # the question (adjacent ones are merged).
    loaded: tuple[SegmentSpan, ...]
    # Prompt length (the question ends there).
    num_tokens: int

    @classmethod
    def for_prompt(cls, prompt: ChunkedPrompt, recompute_tokens: int) -> "PrefillPlan":
        """The system segment is always loaded (it sees nothing before it, so
        recomputing it would change nothing); of each chunk, all but its first
        `recompute_tokens` tokens."""
        if recompute_tokens < 0:
            raise ValueError(
                f"--chunk-recompute-tokens must be >= 0, got {recompute_tokens}"
            )
        stretches = [prompt.system_span]
        for span in prompt.chunk_spans:
            start = min(span.start + recompute_tokens, span.end)
            if start == span.end:
                continue  # the whole chunk is recomputed
            if stretches[-1].end == start:
                stretches[-1] = SegmentSpan(stretches[-1].start, span.end)
            else:
                stretches.append(SegmentSpan(start, span.end))
        return cls(loaded=tuple(stretches), num_tokens=len(prompt.token_ids))

    @property
    def num_loaded(self) -> int:
        return sum(s.num_tokens for s in self.loaded)

    @property
    def num_recomputed(self) -> int:
        """Chunk tokens computed inside the request (the question excluded)."""
        return self.loaded[-1].end - self.num_loaded

    @property
    def num_steps(self) -> int:
        """Engine steps of the prefill (one per computed stretch)."""
        return len(self.loaded)

    def step_at(self, position: int) -> PrefillStep:
        """What to load at `position` and how much to compute after it."""
        if not 0 <= position < self.num_tokens:
            raise ValueError(
                f"position {position} is outside the prompt [0, {self.num_tokens})"
            )
        loaded_end = position
        for stretch in self.loaded:
            if stretch.start <= position < stretch.end:
                loaded_end = stretch.end
            elif stretch.start > loaded_end:
                return PrefillStep(loaded_end - position, stretch.start - loaded_end)
        return PrefillStep(loaded_end - position, self.num_tokens - loaded_end)

    def steps_from(self, position: int) -> tuple[PrefillStep, ...]:
        """Every step from `position` to the end of the prompt, in order."""
        steps = []
        while position < self.num_tokens:
            step = self.step_at(position)
            steps.append(step)
            position += step.num_loaded + step.max_computed
        return tuple(steps)

    def steps_at(self, position: int, one_step: bool) -> tuple[PrefillStep, ...]:
        """What a step at `position` may take: its load and computed stretch,
        or with `one_step` every later one too; () past the prompt (a resumed
        request whose prefix-cache hit covers it)."""
        if position >= self.num_tokens:
            return ()
        return self.steps_from(position) if one_step else (self.step_at(position),)

    def loaded_from(self, position: int, num_tokens: int) -> tuple[SegmentSpan, ...]:
        """The first `num_tokens` loaded tokens from `position` on, as spans
        in prompt order (the computed tokens between them skipped)."""
        spans = []
        left = num_tokens
        for stretch in self.loaded:
            if left == 0:
                break
            start = max(stretch.start, position)
            if start >= stretch.end:
                continue
            end = min(stretch.end, start + left)
            spans.append(SegmentSpan(start, end))
            left -= end - start
        if left:
            raise ValueError(
                f"{num_tokens} tokens to load from position {position}, but only "
                f"{num_tokens - left} are loaded after it"
            )
        return tuple(spans)
