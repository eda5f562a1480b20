# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The parents' loads of one scheduler step (the scheduler side of the
boundary recompute): which stretch a parent loads at its position and how
much it computes after it, under --max-chunk-load-tokens; where that stretch
starts until the scheduler allocates it; what was allocated, until the step's
metadata is built (`end_step`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm.distributed.kv_transfer.kv_connector.v1.base import PrefillGap
from vllm.v1.core.chunk_prefill_plan import PrefillStep
from vllm.v1.core.chunk_step_decision import StepDecision
from vllm.v1.core.chunk_structures import ChunkLoadPlan


@dataclass
class _RequestStep:
    # The manager's decision, asked once per step.
    decision: StepDecision
    # The last reported stretch to load [load_start, load_end), between the
    # report and the scheduler's allocation.
    load_start: int | None = None
    load_end: int | None = None

    def report(self, position: int, steps: tuple[PrefillStep, ...]) -> None:
        """Remember where the stretch to load starts until the scheduler
        allocates it. NOTE: the waiting path asks twice (matched tokens, then
        the gap after them, which loads nothing): only a report that loads
        replaces the start; with later stretches the loads start here unless
        the last report's stretch ends here."""
        if steps[0].num_loaded:
            self.load_start, self.load_end = position, position + steps[0].num_loaded
        elif len(steps) > 1 and self.load_end != position:
            self.load_start = self.load_end = position

    def drop_report(self) -> int | None:
        """The reported start, forgotten (allocated, or not this step)."""
        start, self.load_start, self.load_end = self.load_start, None, None
        return start


@dataclass(frozen=True)
class PendingLoad:
    """Stretches the scheduler allocated to a parent in this step."""

    # The parent's paged block ids.
    block_ids: list[int]
    # The loaded stretches [start, end); positions before the first are
    # computed or hit vLLM's prefix cache.
    spans: tuple[tuple[int, int], ...]
    decision: StepDecision

    def load_plan(self) -> ChunkLoadPlan:
        """The decision's rows for every loaded stretch."""
        plans = [self.decision.load_plan(start, end) for start, end in self.spans]
        return ChunkLoadPlan(
            request_id=self.decision.request_id,
            segments=tuple(seg for p in plans for seg in p.segments),
        )


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
        now = self._requests[rid]
        steps = now.decision.plan.steps_at(position, one_step=False)
        if not steps:
            return 0
        now.report(position, steps)
        if not self._fits_this_step(now, steps[0].num_loaded):
            return None
        return steps[0].num_loaded

    def gap(self, rid: str, position: int, one_step: bool) -> PrefillGap | None:
        """A running request's gap, or the waiting path's after its matched
        tokens (`one_step`: the start-up decision, recompute_step.py): what
        to load at `position` and compute after it, and in one-step mode
        every later stretch of the prompt."""
        now = self._requests[rid]
        steps = now.decision.plan.steps_at(position, one_step)
        if not steps:
            return None
        now.report(position, steps)
        first, later = steps[0], steps[1:]
        if later and not self._fits_more(sum(s.num_loaded for s in steps)):
            # NOTE: past this step's load cap: the first stretch only.
            later = ()
        if not self._fits_this_step(now, first.num_loaded):
            # NOTE: computing nothing, never without the load: asked again next step.
            return PrefillGap(num_external_tokens=0, max_new_tokens=0)
        gaps = [PrefillGap(s.num_loaded, s.max_computed) for s in (first, *later)]
        return replace(gaps[0], next_stretches=tuple(gaps[1:]))

    def allocated(
        self, rid: str, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The scheduler allocated `num_external_tokens` external tokens."""
        now = self._requests.get(rid)
        first = None if now is None else now.drop_report()
        if num_external_tokens == 0 or first is None:
            # NOTE: an earlier allocation in this step was preempted since.
            self._pending.pop(rid, None)
            return
        assert now is not None
        # From `first` on, the first `num_external_tokens` loaded tokens of the
        # plan (computed heads skipped).
        spans = now.decision.plan.loaded_from(first, num_external_tokens)
        self._pending[rid] = PendingLoad(
            block_ids, tuple((s.start, s.end) for s in spans), now.decision
        )
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

    def _fits_more(self, num_rows: int) -> bool:
        """Whether a load of `num_rows` stays within this step's cap. The
        first load of a step always fits (a load longer than the cap runs
        alone, in pieces, on the workers), so every request gets its turn."""
        return self._rows == 0 or self._rows + num_rows <= self._max_load_rows

    def _fits_this_step(self, now: _RequestStep, num_rows: int) -> bool:
        if num_rows == 0 or self._fits_more(num_rows):
            return True
        now.drop_report()
        return False
