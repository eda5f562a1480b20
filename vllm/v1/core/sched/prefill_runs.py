# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Several computed stretches of one prompt in one step, each a query run
(`SchedulerOutput.query_runs`), the loads between them allocated like
external hits (`PrefillGap.next_stretches`). Why: docs/design/boundary-recompute.md,
"Why one step"."""

from dataclasses import dataclass
from typing import Any

# (first position, number of tokens) of one query run.
QueryRun = tuple[int, int]


def max_query_rows(max_num_seqs: int, compilation_config: Any) -> int | None:
    """The most attention rows a step's query runs may take (None: no bound).
    NOTE: with full CUDA graphs FlashAttention 3 copies its scheduler metadata
    into a buffer of max(max_num_seqs, largest capture size) rows on every
    step; the scheduler does not know the backend, so it bounds them all."""
    mode = getattr(compilation_config, "cudagraph_mode", None)
    if mode is None or not mode.has_full_cudagraphs():
        return None
    capture = getattr(compilation_config, "max_cudagraph_capture_size", None) or 0
    return max(max_num_seqs, capture)


@dataclass(frozen=True)
class PrefillRuns:
    """The stretches one request takes in one step, from `first_position`
    (its num_computed_tokens before the step) on."""

    first_position: int
    # (tokens loaded, tokens computed right after them), in prompt order.
    stretches: tuple[tuple[int, int], ...]

    @classmethod
    def of_gap(cls, position: int, gap: Any, num_left: int) -> "PrefillRuns":
        """Every stretch a connector's `PrefillGap` offers at `position`, for a
        request with `num_left` tokens to compute there (loads included)."""
        first = (
            gap.num_external_tokens,
            min(num_left - gap.num_external_tokens, gap.max_new_tokens),
        )
        rest = tuple(
            (g.num_external_tokens, g.max_new_tokens)
            for g in getattr(gap, "next_stretches", ())
        )
        return cls(position, (first,) + rest)

    @property
    def num_external_tokens(self) -> int:
        return sum(loaded for loaded, _ in self.stretches)

    @property
    def num_new_tokens(self) -> int:
        return sum(computed for _, computed in self.stretches)

    def truncated(self, num_new_tokens: int) -> "PrefillRuns":
        """The first `num_new_tokens` computed tokens and the loads before
        them (the scheduler's caps apply to computed tokens only; a stretch
        they cut is finished in a later step)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        kept: list[tuple[int, int]] = []
        left = num_new_tokens
        for loaded, computed in self.stretches:
            if kept and left == 0:
                break
            take = min(computed, left)
            kept.append((loaded, take))
            left -= take
        return PrefillRuns(self.first_position, tuple(kept))

    def at_most_runs(self, max_runs: int) -> "PrefillRuns":
        """The stretches up to the `max_runs`-th computed one (the loads after
        it dropped: a later step takes them with their runs)."""
        if max_runs < 1:
            raise ValueError(f"max_runs must be >= 1, got {max_runs}")
        kept: list[tuple[int, int]] = []
        runs = 0
        for loaded, computed in self.stretches:
            if runs == max_runs:
                break
            kept.append((loaded, computed))
            runs += computed > 0
        return PrefillRuns(self.first_position, tuple(kept))

    def query_runs(self) -> tuple[QueryRun, ...]:
        """(first position, length) of each computed stretch, in order."""
        runs = []
        position = self.first_position
        for loaded, computed in self.stretches:
            position += loaded
            if computed:
                runs.append((position, computed))
            position += computed
        return tuple(runs)

    @property
    def is_split(self) -> bool:
        """Whether the model runner must be told (more than one run: with one,
        its positions already follow from num_computed_tokens)."""
        return len(self.query_runs()) > 1


@dataclass
class RunRowBudget:
    """The rows a step's query runs may add beyond one per request (at most
    min(max_num_seqs, requests) of them), in scheduling order, under
    `max_query_rows`. A request whose runs do not fit takes the rest in a
    later step (exact: its plan is asked again from there)."""

    max_rows: int | None
    max_num_seqs: int
    extra_left: int = 0

    @classmethod
    def of_config(cls, vllm_config: Any) -> "RunRowBudget":
        max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        compilation = getattr(vllm_config, "compilation_config", None)
        return cls(max_query_rows(max_num_seqs, compilation), max_num_seqs)

    def start_step(self, num_requests: int) -> None:
        """A new step, with at most `num_requests` requests to schedule."""
        if self.max_rows is not None:
            self.extra_left = max(
                0, self.max_rows - min(self.max_num_seqs, num_requests)
            )

    def take(self, runs: PrefillRuns) -> PrefillRuns:
        """`runs` with no more query runs than the rows left allow; counts them."""
        if self.max_rows is None:
            return runs
        kept = runs.at_most_runs(1 + self.extra_left)
        self.extra_left -= max(0, len(kept.query_runs()) - 1)
        return kept
