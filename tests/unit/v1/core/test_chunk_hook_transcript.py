# SPDX-License-Identifier: Apache-2.0
"""The chunk cache's scheduler hooks, step by step, on vLLM's own Scheduler with no
model: every hook's return in each scenario equals its golden transcript
(transcripts/*.json, recorded before the scheduler side's redesign of issue 51;
hook_transcript.py says what is recorded).

A transcript that differs is a change of behaviour: only a named defect may change
one, with its own test (issue 51's closing note lists every difference). To record
a scenario again after such a fix: CHUNK_TRANSCRIPT_UPDATE=1, then review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm import __version__ as vllm_version

from tests.unit.v1.core.hook_transcript import (
    BLOCK,
    SINK,
    SchedulerShape,
    Transcript,
    check_golden,
    make_request,
    make_scheduler,
    prompt,
)

# NOTE: one set per base: vLLM 0.32's block pool hands out other block ids (its
# free queue's order), so the same hooks carry other paged block ids there.
GOLDEN = Path(__file__).parent / "transcripts" / ".".join(vllm_version.split(".")[:2])
UPDATE = os.environ.get("CHUNK_TRANSCRIPT_UPDATE") == "1"

SYS = list(range(100, 116))  # 16 tokens: one pool block
D1 = list(range(200, 240))  # 40 tokens: three pool blocks
D2 = list(range(300, 340))
D3 = list(range(400, 440))


def q(n: int, length: int = 8) -> list[int]:
    return list(range(600 + 10 * n, 600 + 10 * n + length))


def add(
    t: Transcript, rid: str, *parts: list[int], priority: int = 0, max_tokens: int = 1
):
    ids, layout = prompt(*parts)
    if len(parts) == 1:
        layout = None  # a plain request
    r = make_request(rid, ids, layout, priority=priority, max_tokens=max_tokens)
    t.scheduler.add_request(r)
    return r


def run_until_idle(t: Transcript, max_steps: int = 30, on_step=None) -> None:
    for _ in range(max_steps):
        t.step(on_step)
        if not t.scheduler.requests:
            return
    raise AssertionError(
        f"still running after {max_steps} steps: {list(t.scheduler.requests)}"
    )


def children(t: Transcript) -> list[str]:
    return [rid for rid in t.scheduler.requests if rid.startswith("chunkcache-child-")]


def pool_blocks(t: Transcript) -> int:
    return t.connector.get_kv_connector_stats().data.get("pool_blocks_total", 0)


# ------------------------------------------------------------------ scenarios


def cold_then_warm(t: Transcript, monkeypatch) -> None:
    add(t, "a", SYS, D1, D2, q(0))
    run_until_idle(t)
    # The same documents in the other order: every segment hits.
    add(t, "b", SYS, D2, D1, q(1))
    run_until_idle(t)


def two_parents_share_a_child_in_flight(t: Transcript, monkeypatch) -> None:
    add(t, "a", SYS, D1, q(0))
    add(t, "b", SYS, D1, D2, q(1))
    run_until_idle(t)


def fifo_deferral_on_a_full_pool(t: Transcript, monkeypatch) -> None:
    # A pool of 8 blocks: a holds 7 (sys + two documents) while its children run;
    # b needs 4 more and waits; c (1 block, would fit) waits behind b.
    add(t, "a", SYS, D1, D2, q(0))
    t.step()
    add(t, "b", SYS, D3, q(1))
    add(t, "c", SYS, q(2))
    run_until_idle(t)


def refusals(t: Transcript, monkeypatch) -> None:
    from vllm.v1.core import chunk_cache_manager
    from vllm.v1.request import RequestStatus

    # Oversized: four documents need 13 blocks of a pool of 8.
    add(t, "big", SYS, D1, D2, D3, list(range(700, 740)), q(0))
    t.step()
    t.step()
    # A collision: D3's key is D1's, with other tokens.
    # (The manager hashes serialised ids: chunk_hash_of_bytes.)
    from vllm.v1.core.chunk_hash_index import token_bytes

    real = chunk_cache_manager.chunk_hash_of_bytes

    def colliding(tokens, context, ns_digest):
        if tokens == token_bytes(D3):
            return real(token_bytes(D1), context, ns_digest)
        return real(tokens, context, ns_digest)

    monkeypatch.setattr(chunk_cache_manager, "chunk_hash_of_bytes", colliding)
    add(t, "warm", SYS, D1, q(1))
    run_until_idle(t)
    add(t, "clash", SYS, D3, q(2))
    run_until_idle(t)
    monkeypatch.setattr(chunk_cache_manager, "chunk_hash_of_bytes", real)
    # A child that ends without its rows twice: its waiters are refused. (A step
    # prefills 32 tokens: each child is aborted after its first piece.)
    add(t, "orphan", SYS, D2, q(3))
    t.step()  # orphan waits; its child is made
    for _ in range(2):
        t.step()  # the child is added and prefills its first piece
        if _ == 0:
            add(t, "joins", SYS, D2, q(4))  # joins the child in flight
        for rid in children(t):
            t.note(f"abort {rid}")
            t.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    run_until_idle(t)


def _recompute(t: Transcript, monkeypatch) -> None:
    sys10 = SYS[:10]
    add(t, "a", sys10, D1, D2, q(0))
    run_until_idle(t)
    # b shares sys10 and D1's first 6 tokens with a: vLLM's prefix cache hits its
    # first block (16 tokens), which ends inside the head (K=12) of b's document.
    other = D1[:6] + list(range(800, 834))
    add(t, "b", sys10, other, D2, q(1))
    run_until_idle(t)


def small_load_cap(t: Transcript, monkeypatch) -> None:
    # Three system prompts, each warmed with D2 and D1; then parents with D1 and D2
    # (the other order: vLLM's prefix cache hits only the system prompt), each
    # loading 80 rows against a cap of 100 per step.
    systems = [list(range(1000 + 100 * i, 1016 + 100 * i)) for i in range(3)]
    for i, sys in enumerate(systems):
        add(t, f"w{i}", sys, D2, D1, q(i))
    run_until_idle(t)
    for i, sys in enumerate(systems):
        add(t, f"p{i}", sys, D1, D2, q(3 + i))
    run_until_idle(t)


def preempted_in_the_allocating_step(t: Transcript, monkeypatch) -> None:
    # tests/unit/v1/core/test_scheduler_prefill_gap.py's case: a's last gap is
    # allocated, then b's decode preempts a in the same step (priority policy).
    a = add(t, "a", SYS, D1, D2, q(0), priority=1, max_tokens=8)
    t.step()
    t.step()
    t.step()
    add(t, "b", list(range(900, 900 + 2 * BLOCK)), priority=0, max_tokens=8)
    run_until_idle(t, 40)
    assert a.num_output_tokens == 8


def reset_with_work_in_flight(t: Transcript, monkeypatch) -> None:
    add(t, "a", SYS, D1, q(0))
    t.step()  # a waits; its children are made, not yet scheduled
    t.note("reset")
    assert (
        t.scheduler.reset_prefix_cache(
            reset_running_requests=True, reset_connector=True
        )
        is not None
    )
    run_until_idle(t)
    add(t, "b", SYS, D1, D2, q(1), max_tokens=4)
    t.step()
    t.step()
    t.step()
    t.note("reset while b runs")
    t.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    run_until_idle(t)


def windowed_null_blocks(t: Transcript, monkeypatch) -> None:
    add(t, "a", SYS, D1, D2, q(0))
    run_until_idle(t)


# ---------------------------------------------------------------- the store


class PresenceStore:
    """The store's existence answers (the only call the scheduler's client makes):
    present iff the key's content hash (its last part) is in `present`."""

    scatters = False

    def __init__(self, present: set[int]):
        self.present = present

    def batch_exists(self, keys):
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.base import (  # noqa: E501
            Presence,
        )

        return [
            Presence.PRESENT
            if int(k.rsplit("/", 1)[1], 16) in self.present
            else Presence.ABSENT
            for k in keys
        ]


class InlineExecutor:
    """The client's query thread, run inline: an existence query sent at a step's
    end has its answer at the next step's first lookup (deterministic)."""

    def __init__(self, *args, **kwargs):
        pass

    def submit(self, fn, *args):
        from concurrent.futures import Future

        f: Future = Future()
        f.set_result(fn(*args))
        return f

    def shutdown(self, *args, **kwargs):
        pass


def _store_spec(port: int, monkeypatch, present: list[list[int]]) -> str:
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store import lookups
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.connection import (  # noqa: E501
        SharedStore,
    )

    spec = f"mooncake://127.0.0.1:{port}?lookup_timeout=600&local_client=none"
    monkeypatch.setattr(lookups, "ThreadPoolExecutor", InlineExecutor)
    hashes = {
        lookups.store_content_hash(seg, [SINK] if seg is not SYS else [], None, "")
        for seg in present
    }
    SharedStore.of(spec).use(PresenceStore(hashes))
    return spec


def identities():
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (  # noqa: E501
        RankIdentity,
        StoreReport,
    )

    return StoreReport(
        identities=[
            RankIdentity(
                epoch=0,
                tp_rank=0,
                pp_rank=0,
                model="m",
                weights_version="w",
                kv_dtype="f32",
                kv_layout="l",
                rope="r",
                compute="c",
            )
        ]
    )


class ScriptedWorkers:
    """The workers' store reports: each fetch handed out in a step is reported in
    that step with `outcome(fetch tokens)`; a failure named in `lent` lends its rows,
    returned `return_after` steps later."""

    def __init__(self, outcome, lent=(), return_after: int = 2):
        self.outcome = outcome
        self.lent = lent
        self.return_after = return_after
        self.returns: dict[str, int] = {}

    def __call__(self, out):
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (  # noqa: E501
            StoreReport,
        )

        outcomes, lent, returned = {}, {}, {}
        for fid in list(self.returns):
            self.returns[fid] -= 1
            if self.returns[fid] == 0:
                returned[fid] = 1
                del self.returns[fid]
        meta = out.kv_connector_metadata
        for fetch in meta.store.fetches if meta.store is not None else ():
            segment = list(fetch.entry.token_ids[fetch.entry.virtual_start :])
            outcomes[fetch.fetch_id] = [self.outcome(segment)]
            if segment in self.lent:
                lent[fetch.fetch_id] = 1
                self.returns[fetch.fetch_id] = self.return_after
        if not (outcomes or lent or returned):
            return None
        return StoreReport(outcomes=outcomes, rows_lent=lent, rows_returned=returned)


def _ok_or_timeout(timed_out):
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (  # noqa: E501
        CAUSE_TIMEOUT,
        CAUSE_VERIFY_FAILED,
        FETCH_OK,
    )

    def outcome(segment):
        if segment in timed_out:
            return CAUSE_TIMEOUT
        if segment == D3:
            return CAUSE_VERIFY_FAILED
        return FETCH_OK

    return outcome


def store_hit_miss_pending(t: Transcript, monkeypatch) -> None:
    # D1 and D3 are in the store, SYS and D2 not; D3's read fails verification.
    workers = ScriptedWorkers(_ok_or_timeout(()))
    t.connector.update_connector_output(_worker_meta(identities()))
    add(t, "a", SYS, D1, D2, D3, q(0))
    run_until_idle(t, on_step=workers)
    add(t, "b", SYS, D1, D2, D3, q(1))
    run_until_idle(t, on_step=workers)


def store_failed_fetch_rows_lent(t: Transcript, monkeypatch) -> None:
    # Every key is in the store; D1's read times out with its rows lent.
    workers = ScriptedWorkers(_ok_or_timeout((D1,)), lent=(D1,))
    t.connector.update_connector_output(_worker_meta(identities()))
    add(t, "a", SYS, D1, q(0))
    run_until_idle(t, on_step=workers)


def _worker_meta(report):
    import types

    return types.SimpleNamespace(kv_connector_worker_meta=report)


# The scheduler each scenario runs on, and the store's contents (None: no store).
SCENARIOS = {
    "cold_then_warm": (cold_then_warm, SchedulerShape(), None),
    "two_parents_share_a_child_in_flight": (
        two_parents_share_a_child_in_flight,
        SchedulerShape(),
        None,
    ),
    "fifo_deferral_on_a_full_pool": (
        fifo_deferral_on_a_full_pool,
        SchedulerShape(num_gpu_blocks=40, pool_fraction=1 / 6),
        None,
    ),
    "refusals": (
        refusals,
        SchedulerShape(num_gpu_blocks=40, pool_fraction=1 / 6, max_batched=32),
        None,
    ),
    "recompute_k12_one_step": (_recompute, SchedulerShape(recompute=12), None),
    "recompute_k12_multi_step": (
        _recompute,
        SchedulerShape(recompute=12, one_step=False),
        None,
    ),
    "small_load_cap": (small_load_cap, SchedulerShape(max_load=100), None),
    "preempted_in_the_allocating_step": (
        preempted_in_the_allocating_step,
        SchedulerShape(recompute=2, one_step=False, num_gpu_blocks=10, priority=True),
        None,
    ),
    "reset_with_work_in_flight": (reset_with_work_in_flight, SchedulerShape(), None),
    "windowed_null_blocks": (
        windowed_null_blocks,
        SchedulerShape(recompute=2, one_step=False, sliding_window=32),
        None,
    ),
    "store_hit_miss_pending": (store_hit_miss_pending, SchedulerShape(), [D1, D3]),
    "store_failed_fetch_rows_lent_with_room": (
        store_failed_fetch_rows_lent,
        SchedulerShape(),
        [SYS, D1],
    ),
    # A pool of 4 blocks: no room to compute D1 elsewhere while its rows are lent.
    "store_failed_fetch_rows_lent_without_room": (
        store_failed_fetch_rows_lent,
        SchedulerShape(num_gpu_blocks=40, pool_fraction=4 / 44),
        [SYS, D1],
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_hook_transcript(name, monkeypatch):
    scenario, shape, present = SCENARIOS[name]
    if present is not None:
        port = 47300 + list(SCENARIOS).index(name)
        shape = SchedulerShape(
            **{**shape.__dict__, "store": _store_spec(port, monkeypatch, present)}
        )
    scheduler = make_scheduler(shape, monkeypatch)
    t = Transcript(scheduler)
    t.steps.append({"pool_blocks": pool_blocks(t)})
    scenario(t, monkeypatch)
    check_golden(GOLDEN / f"{name}.json", t.steps, UPDATE)
