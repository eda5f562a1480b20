# SPDX-License-Identifier: Apache-2.0
"""What the manager answers the engine glue: one decision per parent per
step, one outcome per event (issue 51). Engine-free, frozen.

`StepDecision` is made once per parent and step (`ChunkCacheManager.decide`):
whether the parent may run, its prefill plan, and every cached segment's
rows with their pool blocks resolved while the parent pins them, so that the
scheduler hooks of that step (matched tokens, prefill gap, allocation,
metadata) read it and never ask the manager again.

`Outcome` is what one event changed: a child finished or failed, or a store
report arrived. Children and fetches to start, parents now ready, and the
store entry to write (the manager decides whether a retired entry is
written: never).
"""

from dataclasses import dataclass, replace

from vllm.v1.core.chunk_prefill_plan import PrefillPlan
from vllm.v1.core.chunk_store_probe import FetchSpec
from vllm.v1.core.chunk_structures import (
    AdmitReason,
    ChildSpec,
    ChunkLoadPlan,
    PoolBlockId,
    SegmentLoad,
)


@dataclass(frozen=True)
class StepDecision:
    """One parent's answer for one scheduler step."""

    request_id: str
    # ADMITTED, DEFERRED (ask again next step) or a refusal.
    reason: AdmitReason
    # Admitted and every segment resident: the parent runs this step.
    ready: bool
    # Its loaded and computed stretches (boundary recompute).
    plan: PrefillPlan
    # Every cached segment's full rows, in prompt order (empty unless ready).
    segments: tuple[SegmentLoad, ...] = ()
    # Children and store fetches this decision started.
    children: tuple[ChildSpec, ...] = ()
    fetches: tuple[FetchSpec, ...] = ()

    @property
    def runs(self) -> bool:
        return self.reason == AdmitReason.ADMITTED and self.ready

    def load_plan(self, first_position: int, end_position: int) -> ChunkLoadPlan:
        """Rows to copy for prompt positions [first_position, end_position):
        those before are in the parent's paged KV already (vLLM's prefix
        cache, or an earlier stretch), those after are loaded later or
        recomputed."""
        loads = []
        for seg in self.segments:
            skip = max(0, min(first_position - seg.dst_start, seg.num_tokens))
            stop = max(0, min(end_position - seg.dst_start, seg.num_tokens))
            if skip >= stop:
                continue
            if skip == 0 and stop == seg.num_tokens:
                loads.append(seg)  # the whole segment (the all-hit case)
                continue
            loads.append(
                replace(
                    seg,
                    first_row=skip,
                    end_row=None if stop == seg.num_tokens else stop,
                )
            )
        return ChunkLoadPlan(request_id=self.request_id, segments=tuple(loads))


@dataclass(frozen=True)
class ChildPut:
    """A finished child's entry to write to the fleet-wide store."""

    # Context + segment ids; rows [store_start, len) are the entry's.
    token_ids: tuple[int, ...]
    store_start: int
    # The tenant part of its store key.
    cache_salt: str | None
    lora: str
    pool_block_ids: tuple[PoolBlockId, ...]
    # The manager's epoch when the child finished (a put of an older one is
    # never written: the workers would key it with the new weights).
    epoch: int


@dataclass(frozen=True)
class Outcome:
    """What one event (a child's end, a store report, a step's write-off of
    held rows) changed."""

    # Children to schedule (retries, failed fetches computed instead).
    children: tuple[ChildSpec, ...] = ()
    # Parents whose every segment is resident now.
    ready: tuple[str, ...] = ()
    # The finished child's entry to write to the store, if any.
    put: ChildPut | None = None
    # Failed fetches whose held rows were written off (`write_off_held`): the
    # store forgets them, so a call's late return is ignored.
    written_off: tuple[str, ...] = ()
