# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the manager answers the engine glue (engine-free, frozen): one
`StepDecision` per parent and step (`ChunkCacheManager.decide`), which every
scheduler hook of the step reads instead of asking the manager again, and
one `Outcome` per event (a child's end, a store report)."""

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
    """One parent's answer for one scheduler step: whether it runs (admitted
    and every segment resident: `ready`), its loaded and computed stretches,
    and once ready every cached segment's rows with their pool blocks,
    resolved while the parent pins them."""

    request_id: str
    reason: AdmitReason
    ready: bool
    plan: PrefillPlan
    segments: tuple[SegmentLoad, ...] = ()
    # Children and store fetches this decision started.
    children: tuple[ChildSpec, ...] = ()
    fetches: tuple[FetchSpec, ...] = ()

    @property
    def runs(self) -> bool:
        return self.reason == AdmitReason.ADMITTED and self.ready

    def load_plan(self, first_position: int, end_position: int) -> ChunkLoadPlan:
        """Rows to copy for prompt positions [first_position, end_position)
        (those before are in the parent's paged KV already)."""
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
    cache_salt: str | None
    lora: str
    pool_block_ids: tuple[PoolBlockId, ...]
    # The manager's epoch when the child finished (a put from an older one
    # is never written: it would be keyed with the new weights).
    epoch: int


@dataclass(frozen=True)
class Outcome:
    """What one event (a child's end, a store report, a step's write-off of
    held rows) changed: children to schedule (retries, failed fetches), the
    parents now ready, the finished child's entry to put, and the failed
    fetches whose held rows were written off (the store forgets them)."""

    children: tuple[ChildSpec, ...] = ()
    ready: tuple[str, ...] = ()
    put: ChildPut | None = None
    written_off: tuple[str, ...] = ()
