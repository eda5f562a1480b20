# SPDX-License-Identifier: Apache-2.0
"""The parents' loads of one scheduler step: the boundary-recompute arithmetic
of the scheduler side, in one place (issue 51).

Which stretch a parent loads at its position and how much it may compute
after it (one stretch per step, or every later one where the model runner
computes query runs: recompute_step.py decides that at start-up), under the
step's load cap (--max-chunk-load-tokens); where the loaded stretch starts
until the scheduler allocates it; the stretches allocated, until the step's
metadata is built. The plan of each prompt (loaded and computed stretches)
is chunk_prefill_plan.py's; the rows, the parent's `StepDecision`'s.

Every fact here lives for one step: `end_step` drops them with the metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import PrefillGap
from vllm.v1.core.chunk_prefill_plan import PrefillPlan, PrefillStep
from vllm.v1.core.chunk_step_decision import StepDecision
from vllm.v1.core.chunk_structures import ChunkLoadPlan


@dataclass
class _RequestStep:
    # The manager's decision, asked once per step.
    decision: StepDecision
    # Position the last reported stretch to load starts at, between the report
    # and the scheduler's allocation.
    load_start: int | None = None


@dataclass(frozen=True)
class PendingLoad:
    """Stretches the scheduler allocated to a parent in this step."""

    # The parent's paged block ids.
    block_ids: list[int]
    # The loaded stretches [start, end) (one, or one per loaded stretch when a
    # step takes several computed ones); positions before the first are
    # computed or hit vLLM's prefix cache.
    spans: tuple[tuple[int, int], ...]
    decision: StepDecision

    def load_plan(self) -> ChunkLoadPlan:
        """The decision's rows for every loaded stretch."""
        plans = [self.decision.load_plan(start, end) for start, end in self.spans]
        return ChunkLoadPlan(request_id=self.decision.request_id,
                             segments=tuple(seg for p in plans for seg in p.segments))


def prefill_gap(plan: PrefillPlan, position: int, one_step: bool) -> PrefillGap:
    """What to load at `position` and compute after it (and, in one-step mode,
    every later stretch of the prompt)."""
    steps = plan.steps_from(position) if one_step else (plan.step_at(position),)
    first = steps[0]
    return PrefillGap(
        num_external_tokens=first.num_loaded,
        max_new_tokens=first.max_computed,
        next_stretches=tuple(
            PrefillGap(num_external_tokens=s.num_loaded, max_new_tokens=s.max_computed)
            for s in steps[1:]
        ),
    )


def num_loaded(gap: PrefillGap) -> int:
    """Tokens a gap (with its next stretches) loads at most."""
    return gap.num_external_tokens + sum(g.num_external_tokens for g in gap.next_stretches)


class StepLoads:
    """This step's decisions, reports and allocations of the parents."""

    def __init__(self, max_load_rows: int):
        self._max_load_rows = max_load_rows
        self._requests: dict[str, _RequestStep] = {}
        self._pending: dict[str, PendingLoad] = {}
        # Rows allocated for loads in this step, against the cap.
        self._rows = 0

    def decision(self, rid: str) -> StepDecision | None:
        now = self._requests.get(rid)
        return None if now is None else now.decision

    def decided(self, rid: str, decision: StepDecision) -> None:
        self._requests[rid] = _RequestStep(decision)

    def matched_tokens(self, rid: str, position: int) -> int | None:
        """The waiting path: tokens loaded from `position` (None: wait for the
        next step, this one's cap is reached)."""
        step = self._report(rid, position)
        if step is None:
            return 0
        if not self._fits_this_step(rid, step.num_loaded):
            return None
        return step.num_loaded

    def gap(self, rid: str, position: int, one_step: bool) -> PrefillGap | None:
        """A running request's gap, or the waiting path's after its matched
        tokens (`one_step`: the start-up decision, recompute_step.py)."""
        step = self._report(rid, position)
        if step is None:
            return None
        gap = self._gap_with_runs(rid, position, one_step)
        if gap.next_stretches and not self._fits_more(num_loaded(gap)):
            # NOTE: the later stretches would pass this step's load cap: this
            # step takes the first computed stretch only.
            gap = PrefillGap(gap.num_external_tokens, gap.max_new_tokens)
        if not self._fits_this_step(rid, gap.num_external_tokens):
            # NOTE: computing nothing, not computing without the load: the
            # running request skips this step and is asked again next step.
            return PrefillGap(num_external_tokens=0, max_new_tokens=0)
        return gap

    def allocated(self, rid: str, block_ids: list[int], num_external_tokens: int) -> None:
        """The scheduler allocated `num_external_tokens` external tokens."""
        now = self._requests.get(rid)
        first = None if now is None else now.load_start
        if now is not None:
            now.load_start = None
        if num_external_tokens == 0 or first is None:
            # NOTE: an earlier allocation in this step was preempted since.
            self._pending.pop(rid, None)
            return
        assert now is not None
        # From `first` on, the first `num_external_tokens` loaded tokens of the
        # plan (computed heads skipped).
        spans = now.decision.plan.loaded_from(first, num_external_tokens)
        self._pending[rid] = PendingLoad(block_ids, tuple((s.start, s.end) for s in spans),
                                         now.decision)
        self._rows += num_external_tokens

    def pending(self) -> dict[str, PendingLoad]:
        return self._pending

    def forget(self, rid: str) -> None:
        self._pending.pop(rid, None)
        self._requests.pop(rid, None)

    def end_step(self) -> None:
        """The step's metadata is built: its facts end."""
        self._pending.clear()
        self._requests.clear()
        self._rows = 0

    # ----------------------------------------------------------- internal

    def _gap_with_runs(self, rid: str, position: int, one_step: bool) -> PrefillGap:
        """The gap at `position`, with every later stretch in one-step mode.

        NOTE: with later stretches, the loads start here even when nothing
        is loaded at `position` (a waiting request whose matched tokens end
        there keeps the start of that report, which ends at `position`)."""
        now = self._requests[rid]
        plan = now.decision.plan
        gap = prefill_gap(plan, position, one_step)
        if gap.next_stretches and gap.num_external_tokens == 0:
            start = now.load_start
            if start is None or start + plan.step_at(start).num_loaded != position:
                now.load_start = position
        return gap

    def _fits_more(self, num_rows: int) -> bool:
        return self._rows == 0 or self._rows + num_rows <= self._max_load_rows

    def _fits_this_step(self, rid: str, num_rows: int) -> bool:
        """Whether a load of `num_rows` stays within this step's cap. The
        first load of a step always fits (a load longer than the cap runs
        alone, in pieces, on the workers), so every request gets its turn."""
        if num_rows == 0 or self._rows == 0:
            return True
        if self._rows + num_rows <= self._max_load_rows:
            return True
        self._requests[rid].load_start = None
        return False

    def _report(self, rid: str, position: int) -> PrefillStep | None:
        """The plan's step at `position`, None past the prompt (a request
        resumed after a preemption whose prefix-cache hit covers its prompt
        and generated tokens); remembers where a stretch to load starts until
        the scheduler allocates it.

        NOTE: in the waiting path the scheduler asks twice (matched tokens,
        then the gap after them, which loads nothing): only a report that
        loads something replaces the start."""
        now = self._requests[rid]
        plan = now.decision.plan
        if position >= plan.num_tokens:
            return None
        step = plan.step_at(position)
        if step.num_loaded:
            now.load_start = position
        return step
