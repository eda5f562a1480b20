# SPDX-License-Identifier: Apache-2.0
"""Test-side views of a ChunkCacheManager, read through its public API only
(`decide`, the pool), for the unit tests that assert on a parent's rows or a
child's destination (issue 51: the manager keeps no query methods of its own
for them)."""

from dataclasses import dataclass

from vllm.v1.core.chunk_step_decision import Outcome
from vllm.v1.core.chunk_store_probe import FetchFailure, ReportResult
from vllm.v1.core.chunk_structures import ChunkHash, ChunkLoadPlan, PoolBlockId


@dataclass(frozen=True)
class StorePlan:
    """Where a child's (or fetch's) rows go: its entry's pool blocks."""

    request_id: str
    chunk_hash: ChunkHash
    # First position of the child's sequence that is stored.
    src_start: int
    num_tokens: int
    pool_block_ids: list[PoolBlockId]


def store_plan(manager, spec) -> StorePlan:
    """`spec`: a ChildSpec or FetchSpec the manager handed out."""
    entry = manager.pool.get(spec.chunk_hash)
    assert entry is not None, "a child's entry is pinned by its writer"
    return StorePlan(
        spec.request_id,
        spec.chunk_hash,
        spec.store_start,
        entry.num_tokens,
        list(entry.block_ids),
    )


def is_ready(manager, request_id: str) -> bool:
    return manager.decide(request_id, admit=False).ready


def load_plan(manager, request_id: str, first_position: int = 0) -> ChunkLoadPlan:
    """A ready parent's rows from `first_position` up to the question.
    NOTE: the prompt length as the end is the question's start here: no
    cached segment reaches into the question."""
    decision = manager.decide(request_id, admit=False)
    assert decision.ready, f"{request_id} is not ready"
    return decision.load_plan(first_position, decision.plan.num_tokens)


def child_finished(manager, child_request_id: str) -> list[str]:
    """The child stored its rows (its put, if any, shipped in the same step):
    the parents now ready."""
    outcome = manager.finish_child(child_request_id, stored=True)
    manager.puts_shipped()
    return list(outcome.ready)


def report(manager, *, done=(), failed=(), lent=(), rows_returned=()) -> Outcome:
    """A store report naming these fetches (`failed`: rows returned by every
    rank; `lent`: failed with rows still held by some rank)."""
    failures = tuple(
        FetchFailure(fid, "error", rows_held=False) for fid in failed
    ) + tuple(FetchFailure(fid, "error", rows_held=True) for fid in lent)
    return manager.store_report(
        ReportResult(
            done=tuple(done), failed=failures, rows_returned=tuple(rows_returned)
        )
    )
