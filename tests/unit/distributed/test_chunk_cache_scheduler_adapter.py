# SPDX-License-Identifier: Apache-2.0
"""The connector's scheduler half with real vLLM Request objects and no engine:
admission when the scheduler asks (not on arrival), children and their retry,
refusal instead of another attention, the one-group check, the base-class
hooks, and the import boundary (engine-core code never imports the front end)."""

from types import SimpleNamespace

import pytest
import torch
from forktool.check import overlay_modules
from forktool.paths import Paths
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.scheduler_adapter import (
    ChunkCacheSchedulerAdapter,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from tests.chunk_manager_views import is_ready, load_plan

BLOCK = 16  # paged block size of the fake KV cache
SINK = 1


def make_config(
    num_kv_blocks=64,
    fraction=0.5,
    groups=1,
    recompute=0,
    scheduler=None,
    max_load=16384,
    store=None,
):
    from vllm.v1.core.sched.scheduler import Scheduler

    chunk = SimpleNamespace(
        chunk_context="sink",
        chunk_sink_token_id=SINK,
        chunk_pool_fraction=fraction,
        chunk_pool_size_gib=None,
        chunk_recompute_tokens=recompute,
        max_chunk_load_tokens=max_load,
        chunk_store=store,
    )
    vllm_config = SimpleNamespace(
        chunk_cache_config=chunk,
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BLOCK),
        model_config=SimpleNamespace(model="m", tokenizer="t", dtype="float32"),
        scheduler_config=SimpleNamespace(
            get_scheduler_cls=lambda: scheduler or Scheduler
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1
        ),
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    group = SimpleNamespace(kv_cache_spec=spec)
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[group] * groups, num_blocks=num_kv_blocks
    )
    return vllm_config, kv_cache_config


def parent(rid, layout, salt=None):
    ids = list(range(10, 10 + sum(layout)))
    r = Request(
        rid,
        ids,
        SamplingParams(max_tokens=2),
        None,
        cache_salt=salt,
        chunk_layout=layout,
    )
    return r


def finish(adapter, request, status):
    request.status = status
    if status == RequestStatus.FINISHED_LENGTH_CAPPED:
        request.num_computed_tokens = request.num_prompt_tokens
    adapter.request_finished(request)


def test_arrival_pins_nothing_and_admission_spawns_children():
    adapter = ChunkCacheSchedulerAdapter(*make_config())
    r = parent("p", [3, 5, 2])
    adapter.on_new_request(r)
    assert adapter.manager.stats().pinned_entries == 0
    assert adapter.take_internal_requests() == []

    assert adapter.get_num_new_matched_tokens(r, 0) == (None, False)
    children = adapter.take_internal_requests()
    assert [c.prompt_token_ids for c in children] == [
        [10, 11, 12],
        [SINK, 13, 14, 15, 16, 17],
    ]
    assert all(c.chunk_layout is None and c.cache_salt is None for c in children)
    assert adapter.manager.stats().pinned_entries == 2
    for c in children:
        finish(adapter, c, RequestStatus.FINISHED_LENGTH_CAPPED)
    # Everything before the question (8 tokens) is served from the pool.
    assert adapter.get_num_new_matched_tokens(r, 0) == (8, False)
    finish(adapter, r, RequestStatus.FINISHED_STOPPED)
    stats = adapter.manager.stats()
    assert (stats.pinned_entries, stats.live_requests, stats.misses) == (0, 0, 2)


class FakeBlocks:
    def __init__(self, block_ids):
        self.block_ids = block_ids

    def get_block_ids(self):
        return (self.block_ids,)


def loaded(meta):
    """A step's loads as the rows the workers expand them into."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
        LoadRows,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        POOL_BLOCK_SIZE,
    )

    rows = LoadRows.expand(meta.loads, POOL_BLOCK_SIZE, BLOCK, torch.device("cpu"))
    return SimpleNamespace(
        src=rows.src_rows.tolist(),
        dst=rows.dst_slots.tolist(),
        deltas=rows.deltas.tolist(),
    )


def step_output(num_scheduled_tokens, preempted=None):
    """The parts of a SchedulerOutput the loads read (no child scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=None,
        num_scheduled_tokens=num_scheduled_tokens,
        preempted_req_ids=preempted,
    )


def test_a_load_of_a_request_preempted_in_the_same_step_is_dropped():
    """The adapter's part only: a load recorded for a request that the step's
    output names as preempted is not sent; the request loads again, into its new
    blocks, when it resumes. (Driven here through the waiting-path hook for brevity,
    a case vLLM does not produce: only running requests are preempted. The case it
    produces, a running request's gap, with the scheduler's eviction of the gap's
    blocks: tests/unit/v1/core/test_scheduler_prefill_gap.py.)"""
    adapter = ChunkCacheSchedulerAdapter(*make_config())
    (r,) = _ready_parents(adapter, [[3, 5, 2]])
    assert adapter.get_num_new_matched_tokens(r, 0) == (8, False)
    adapter.update_state_after_alloc(r, FakeBlocks([7]), 8)
    meta = adapter.build_connector_meta(step_output({}, preempted={"p0"}))
    assert loaded(meta).dst == [] and loaded(meta).src == []

    # Resumed in a later step with other blocks: loaded there, and only there.
    assert adapter.get_num_new_matched_tokens(r, 0) == (8, False)
    adapter.update_state_after_alloc(r, FakeBlocks([3]), 8)
    meta = adapter.build_connector_meta(step_output({"p0": 2}))
    assert loaded(meta).dst == [48 + p for p in range(8)]
    finish(adapter, r, RequestStatus.FINISHED_STOPPED)
    assert adapter.manager.stats().pinned_entries == 0


def test_a_request_preempted_between_steps_and_resumed_loads_in_its_new_step():
    """VLLM 0.32 names a request preempted between steps (a cache reset with
    running requests) in the next step's preempted ids even when that step
    resumes it: its load belongs to the resumed step and must run (found by the
    e2e preemption row of test_chunk_cache_recompute_steps.py: dropped, the
    request read whatever its new blocks held)."""
    adapter = ChunkCacheSchedulerAdapter(*make_config())
    (r,) = _ready_parents(adapter, [[3, 5, 2]])
    assert adapter.get_num_new_matched_tokens(r, 0) == (8, False)
    adapter.update_state_after_alloc(r, FakeBlocks([3]), 8)
    meta = adapter.build_connector_meta(step_output({"p0": 2}, preempted={"p0"}))
    assert loaded(meta).dst == [48 + p for p in range(8)]
    finish(adapter, r, RequestStatus.FINISHED_STOPPED)


def test_connector_reset_forgets_every_segment_and_reports_pinned_ones():
    """`reset_cache` (vLLM's cache reset after a weight update, sleep or
    pause(clear_cache)) answers a bool, never None (which vLLM reads as
    success without a reset); afterwards the same documents are computed
    again by new children."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.connector import (
        ChunkCacheConnector,
    )

    connector = ChunkCacheConnector.__new__(ChunkCacheConnector)
    connector._scheduler = adapter = ChunkCacheSchedulerAdapter(*make_config())
    (r,) = _ready_parents(adapter, [[3, 5, 2]])
    assert adapter.get_num_new_matched_tokens(r, 0) == (8, False)
    # p still holds its two entries: retired, not freed under it.
    assert connector.reset_cache() is False
    finish(adapter, r, RequestStatus.FINISHED_STOPPED)
    assert adapter.manager.stats().pool_blocks_used == 0

    again = parent("q", [3, 5, 2])
    adapter.on_new_request(again)
    assert adapter.get_num_new_matched_tokens(again, 0) == (None, False)
    assert len(adapter.take_internal_requests()) == 2  # recomputed, not hit
    assert connector.reset_cache() is False  # q's children write under pins
    finish(adapter, again, RequestStatus.FINISHED_ABORTED)


def test_boundary_recompute_loads_each_rest_in_the_step_before_its_next_head(
    monkeypatch,
):
    """K=2: [sys 3][doc 5][doc 4][question 2] -> load sys, compute doc1[:2],
    load doc1[2:], compute doc2[:2], load doc2[2:], compute the question; each
    stretch's rows land in the request's slots at their real positions. (The
    multi-step path: other platforms, or CHUNK_CACHE_RECOMPUTE_ONE_STEP=0.)"""
    monkeypatch.setenv("CHUNK_CACHE_RECOMPUTE_ONE_STEP", "0")
    adapter = ChunkCacheSchedulerAdapter(*make_config(recompute=2))
    assert not adapter._steps.one_step
    r = parent("p", [3, 5, 4, 2])
    adapter.on_new_request(r)
    assert adapter.get_num_new_matched_tokens(r, 0) == (None, False)
    for c in adapter.take_internal_requests():
        finish(adapter, c, RequestStatus.FINISHED_LENGTH_CAPPED)
    out = step_output({"p": 2})
    blocks = FakeBlocks([7])  # one paged block of 16 slots: slot = 7 * 16 + pos

    assert adapter.get_num_new_matched_tokens(r, 0) == (3, False)
    assert adapter.get_prefill_gap(r, 3).max_new_tokens == 2  # doc1's head
    adapter.update_state_after_alloc(r, blocks, 3)
    meta = adapter.build_connector_meta(out)
    assert loaded(meta).dst == [112, 113, 114]  # positions 0..2

    gap = adapter.get_prefill_gap(r, 5)  # after doc1's head
    assert (gap.num_external_tokens, gap.max_new_tokens) == (3, 2)
    adapter.update_state_after_alloc(r, blocks, 3)
    meta = adapter.build_connector_meta(out)
    assert loaded(meta).dst == [112 + p for p in (5, 6, 7)]
    # The pool rows of doc1 from its third token on, rotated by its real start.
    assert len(loaded(meta).src) == 3 and set(loaded(meta).deltas) == {3 - 1}

    gap = adapter.get_prefill_gap(r, 10)  # after doc2's head
    assert (gap.num_external_tokens, gap.max_new_tokens) == (2, 2)
    adapter.update_state_after_alloc(r, blocks, 2)
    assert loaded(adapter.build_connector_meta(out)).dst == [112 + 10, 112 + 11]
    gap = adapter.get_prefill_gap(r, 12)  # the question: nothing more to load
    assert (gap.num_external_tokens, gap.max_new_tokens) == (0, 2)
    adapter.update_state_after_alloc(r, blocks, 0)
    assert loaded(adapter.build_connector_meta(out)).dst == []
    assert adapter.manager.stats().tokens_loaded == 3 + 3 + 2
    # Past the prompt (resumed after a preemption with generated tokens that vLLM's
    # prefix cache still holds): nothing to load, no cap.
    assert adapter.get_prefill_gap(r, 14) is None
    assert adapter.get_num_new_matched_tokens(r, 15) == (0, False)
    finish(adapter, r, RequestStatus.FINISHED_STOPPED)


def test_boundary_recompute_in_one_step_loads_every_rest_before_the_forward():
    """K=2 in one step (the CPU backend): [sys 3][doc 5][doc 4][question 2] ->
    load sys, doc1[2:] and doc2[2:] and compute both heads and the question in
    the same step; the heads' slots are not loaded (the forward writes them).
    A step budget that stops inside doc2's head leaves doc2's rest for later."""
    adapter = ChunkCacheSchedulerAdapter(*make_config(recompute=2))
    assert adapter._steps.one_step, adapter._steps.reason
    r = parent("p", [3, 5, 4, 2])
    adapter.on_new_request(r)
    assert adapter.get_num_new_matched_tokens(r, 0) == (None, False)
    for c in adapter.take_internal_requests():
        finish(adapter, c, RequestStatus.FINISHED_LENGTH_CAPPED)
    blocks = FakeBlocks([7])  # slot = 7 * 16 + pos

    assert adapter.get_num_new_matched_tokens(r, 0) == (3, False)
    gap = adapter.get_prefill_gap(r, 3)
    assert (gap.num_external_tokens, gap.max_new_tokens) == (0, 2)
    assert [(g.num_external_tokens, g.max_new_tokens) for g in gap.next_stretches] == [
        (3, 2),
        (2, 2),
    ]
    # The scheduler took everything: sys (3) plus the two rests (3 + 2) as external.
    adapter.update_state_after_alloc(r, blocks, 3 + 3 + 2)
    meta = adapter.build_connector_meta(step_output({"p": 6}))
    assert loaded(meta).dst == [112 + p for p in (0, 1, 2, 5, 6, 7, 10, 11)]
    assert adapter.manager.stats().tokens_loaded == 8
    finish(adapter, r, RequestStatus.FINISHED_STOPPED)

    # A budget of 3 computed tokens: doc1's head and one token of doc2's head,
    # so doc1's rest is loaded and doc2's is not (yet).
    r = parent("q", [3, 5, 4, 2])
    adapter.on_new_request(r)
    assert adapter.get_num_new_matched_tokens(r, 0) == (3, False)
    adapter.get_prefill_gap(r, 3)
    adapter.update_state_after_alloc(r, blocks, 3 + 3)
    meta = adapter.build_connector_meta(step_output({"q": 3}))
    assert loaded(meta).dst == [112 + p for p in (0, 1, 2, 5, 6, 7)]
    # Next step, inside doc2's head: finish it, load doc2's rest, the question.
    gap = adapter.get_prefill_gap(r, 9)
    assert (gap.num_external_tokens, gap.max_new_tokens) == (0, 1)
    assert [(g.num_external_tokens, g.max_new_tokens) for g in gap.next_stretches] == [
        (2, 2)
    ]
    adapter.update_state_after_alloc(r, blocks, 2)
    meta = adapter.build_connector_meta(step_output({"q": 3}))
    assert loaded(meta).dst == [112 + 10, 112 + 11]
    finish(adapter, r, RequestStatus.FINISHED_STOPPED)
    assert adapter.manager.stats().pinned_entries == 0


def test_boundary_recompute_refuses_a_scheduler_that_replaces_schedule_at_start_up():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    class OwnLoop(Scheduler):  # e.g. one of vllm-ascend's optional schedulers
        def schedule(self, *args, **kwargs):
            raise AssertionError("never called")

    ChunkCacheSchedulerAdapter(*make_config(recompute=4, scheduler=AsyncScheduler))
    ChunkCacheSchedulerAdapter(*make_config(recompute=0, scheduler=OwnLoop))
    with pytest.raises(ValueError, match="runs the schedule\\(\\) of .*OwnLoop"):
        ChunkCacheSchedulerAdapter(*make_config(recompute=4, scheduler=OwnLoop))

    class NotVllms:  # implements the interface from scratch: nothing known
        def schedule(self):
            raise AssertionError("never called")

    with pytest.raises(ValueError, match="needs vLLM's scheduler or a subclass"):
        ChunkCacheSchedulerAdapter(*make_config(recompute=0, scheduler=NotVllms))


def test_a_request_without_layout_is_not_touched_whatever_its_salt():
    adapter = ChunkCacheSchedulerAdapter(*make_config())
    r = Request(
        "plain",
        list(range(20)),
        SamplingParams(max_tokens=1),
        None,
        cache_salt="vllm-chunk-cache/v1/3,2,15/=tenantB",
    )
    adapter.on_new_request(r)
    assert adapter.get_num_new_matched_tokens(r, 0) == (0, False)
    assert adapter.manager.stats().live_requests == 0


def test_failed_child_is_retried_then_the_parent_is_finished_with_an_error():
    adapter = ChunkCacheSchedulerAdapter(*make_config())
    r = parent("p", [3, 5, 2], salt="tenant")
    adapter.on_new_request(r)
    adapter.get_num_new_matched_tokens(r, 0)
    sys_child, doc_child = adapter.take_internal_requests()
    assert doc_child.cache_salt == "tenant"  # children stay in the tenant's namespace
    finish(adapter, doc_child, RequestStatus.FINISHED_ABORTED)
    (retry,) = adapter.take_internal_requests()
    assert retry.prompt_token_ids == doc_child.prompt_token_ids
    assert adapter.take_failed_requests() == {}
    finish(adapter, retry, RequestStatus.FINISHED_ABORTED)
    failed = adapter.take_failed_requests()
    assert list(failed) == ["p"]
    assert "document 1 of this request (5 tokens" in failed["p"]
    assert "the last ended FINISHED_ABORTED" in failed["p"]
    assert "retrying the request is safe" in failed["p"]
    # Never served with another attention: it waits until finished with an error.
    assert adapter.get_num_new_matched_tokens(r, 0) == (None, False)
    finish(adapter, sys_child, RequestStatus.FINISHED_LENGTH_CAPPED)
    finish(adapter, r, RequestStatus.FINISHED_ERROR)
    stats = adapter.manager.stats()
    assert stats.pinned_entries == 0 and stats.live_requests == 0


def test_oversized_request_is_refused_not_served_causally():
    # The pool is carved out of the KV budget: pool = kv * f / (1 - f), so
    # f = 1/3 gives 0.5 * 4 * 16 = 32 rows = 2 blocks; the segments need 1 + 2.
    adapter = ChunkCacheSchedulerAdapter(*make_config(num_kv_blocks=4, fraction=1 / 3))
    r = parent("p", [3, 20, 2])
    adapter.on_new_request(r)
    assert adapter.get_num_new_matched_tokens(r, 0) == (None, False)
    assert "chunk pool" in adapter.take_failed_requests()["p"]
    assert adapter.take_internal_requests() == []


def test_more_than_one_kv_cache_group_is_refused_at_start_up():
    with pytest.raises(ValueError, match="one KV cache group"):
        ChunkCacheSchedulerAdapter(*make_config(groups=2))


def test_new_connector_hooks_are_base_class_methods_with_no_op_defaults():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    for name in (
        "register_model",
        "take_internal_requests",
        "take_failed_requests",
        "get_prefill_gap",
    ):
        method = getattr(KVConnectorBase_V1, name)
        assert not getattr(method, "__isabstractmethod__", False), name
    stub = object()  # the defaults use nothing of the instance
    assert KVConnectorBase_V1.take_internal_requests(stub) == []
    assert KVConnectorBase_V1.take_failed_requests(stub) == {}
    assert KVConnectorBase_V1.register_model(stub, object()) is None
    assert KVConnectorBase_V1.get_prefill_gap(stub, object(), 0) is None


def test_engine_core_connector_does_not_import_front_end_code():
    """The connector and the scheduler-side core never import front-end code.

    NOTE: checked on the fork's own modules (their import statements, followed through
    every overlay module they import), not on sys.modules: vLLM 0.32 itself imports
    `vllm.renderers` from the engine core (vllm.parser), which is upstream's business.
    """
    import ast

    overlay = overlay_modules(Paths.default())
    start = "vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.connector"
    seen, todo, bad = set(), [start], []
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for node in ast.walk(ast.parse(overlay[mod].read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
            for name in names:
                if name.startswith(("vllm.renderers", "vllm.entrypoints")):
                    bad.append(f"{mod} imports {name}")
                todo.extend(m for m in overlay if name == m or name.startswith(m + "."))
    assert len(seen) > 5, seen  # the walk really followed the connector's imports
    assert not bad, bad


def test_lora_adapters_are_keyed_in_the_pool_by_name_and_id_as_vllm_loads_them():
    """Issue 50, finding 6: in this engine's pool an adapter is what vLLM loaded for
    its (name, int id): vLLM's LoRA caches load an id once and keep those weights,
    whatever its files become. Another id, or another name on the same id, is
    computed afresh; the same name and id hit. No file is read."""
    from vllm.lora.request import LoRARequest

    adapter = ChunkCacheSchedulerAdapter(*make_config())

    def with_lora(rid, name, int_id):
        r = parent(rid, [3, 5, 2])
        r.lora_request = LoRARequest(name, int_id, "/no/such/adapter/" + name)
        adapter.on_new_request(r)
        adapter.get_num_new_matched_tokens(r, 0)
        return adapter.take_internal_requests()

    children = with_lora("a", "sql", 1)
    assert len(children) == 2 and all(
        c.lora_request.lora_name == "sql" for c in children
    )
    for c in children:
        finish(adapter, c, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert with_lora("b", "sql", 1) == []
    assert len(with_lora("c", "sql", 7)) == 2
    assert len(with_lora("d", "chat", 1)) == 2


def test_tokens_loaded_counts_the_rows_sent_not_the_plans_asked_for():
    """Issue 20, finding 9: load_plan is a query. Before: every call counted
    its rows, so a plan asked twice (or dropped) counted as loaded."""
    adapter = ChunkCacheSchedulerAdapter(*make_config())
    _ready_parents(adapter, [[3, 5, 2]])
    assert load_plan(adapter.manager, "p0").num_rows_to_copy == 8
    assert load_plan(adapter.manager, "p0").num_rows_to_copy == 8
    assert adapter.manager.stats().tokens_loaded == 0


def _ready_parents(adapter, layouts):
    parents = []
    for i, layout in enumerate(layouts):
        r = parent(f"p{i}", layout)
        adapter.on_new_request(r)
        adapter.get_num_new_matched_tokens(r, 0)
        parents.append(r)
    for c in adapter.take_internal_requests():
        finish(adapter, c, RequestStatus.FINISHED_LENGTH_CAPPED)
    return parents


def test_loads_past_the_per_step_cap_wait_for_the_next_step():
    """Issue 20, finding 3. Before: every ready request's load went into the
    same step (here 3 x 8 rows with a cap of 10), however many."""
    adapter = ChunkCacheSchedulerAdapter(*make_config(max_load=10))
    a, b, c = _ready_parents(adapter, [[3, 5, 2]] * 3)
    # The first load of a step always fits (here 8 <= 10); the next would pass it.
    assert adapter.get_num_new_matched_tokens(a, 0) == (8, False)
    adapter.update_state_after_alloc(a, FakeBlocks([1]), 8)
    assert adapter.get_num_new_matched_tokens(b, 0) == (None, False)
    assert adapter.get_num_new_matched_tokens(c, 0) == (None, False)
    meta = adapter.build_connector_meta(step_output({"p0": 2}))
    assert len(loaded(meta).src) == 8
    # Next step: b's turn (c waits again), then c's.
    assert adapter.get_num_new_matched_tokens(b, 0) == (8, False)
    adapter.update_state_after_alloc(b, FakeBlocks([2]), 8)
    assert adapter.get_num_new_matched_tokens(c, 0) == (None, False)
    assert loaded(adapter.build_connector_meta(step_output({"p1": 2}))).dst == [
        32 + p for p in range(8)
    ]
    assert adapter.get_num_new_matched_tokens(c, 0) == (8, False)


def test_a_load_longer_than_the_cap_runs_alone():
    adapter = ChunkCacheSchedulerAdapter(*make_config(max_load=4))
    a, b = _ready_parents(adapter, [[3, 5, 2], [3, 5, 2]])
    assert adapter.get_num_new_matched_tokens(a, 0) == (8, False)
    adapter.update_state_after_alloc(a, FakeBlocks([1]), 8)
    assert adapter.get_num_new_matched_tokens(b, 0) == (None, False)
    # A request that asked but was not allocated (no blocks) takes no room.
    adapter.build_connector_meta(step_output({"p0": 2}))
    assert adapter.get_num_new_matched_tokens(b, 0) == (8, False)
    assert adapter.get_num_new_matched_tokens(a, 0) == (8, False)


def test_a_running_request_whose_stretch_passes_the_cap_computes_nothing_this_step():
    """With boundary recompute a running request loads a stretch per step:
    over the cap it is scheduled for nothing (max_new_tokens 0), never for
    computing the tokens the cache should load."""
    adapter = ChunkCacheSchedulerAdapter(*make_config(recompute=2, max_load=4))
    a, b = _ready_parents(adapter, [[3, 5, 4, 2], [3, 5, 4, 2]])
    assert adapter.get_num_new_matched_tokens(a, 0) == (3, False)
    adapter.update_state_after_alloc(a, FakeBlocks([1]), 3)
    adapter.build_connector_meta(step_output({"p0": 2}))
    assert adapter.get_num_new_matched_tokens(b, 0) == (3, False)
    adapter.update_state_after_alloc(b, FakeBlocks([2]), 3)
    gap = adapter.get_prefill_gap(a, 5)  # doc1's rest: 3 rows, 3 + 3 > 4
    assert (gap.num_external_tokens, gap.max_new_tokens) == (0, 0)
    meta = adapter.build_connector_meta(step_output({"p1": 2}))
    assert loaded(meta).dst == [32, 33, 34]
    gap = adapter.get_prefill_gap(a, 5)
    assert (gap.num_external_tokens, gap.max_new_tokens) == (3, 2)


def stored(meta):
    """A step's captures as the rows the workers expand them into."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
        StoreRows,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        POOL_BLOCK_SIZE,
    )

    rows = StoreRows.expand(meta.stores, POOL_BLOCK_SIZE, BLOCK, torch.device("cpu"))
    return rows.src_slots.tolist(), rows.dst_rows.tolist()


def test_a_child_prefilled_in_pieces_stores_each_piece_as_block_ids():
    """Captures travel as block ids (issue 20, finding 6): per child and step
    its paged blocks, its entry's pool blocks and the positions computed; the
    sink (position 0) is computed, never stored."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
        ChildStore,
    )

    adapter = ChunkCacheSchedulerAdapter(*make_config())
    r = parent("p", [3, 5, 2])
    adapter.on_new_request(r)
    adapter.get_num_new_matched_tokens(r, 0)
    sys_child, doc_child = adapter.take_internal_requests()
    # NOTE: the document's entry is pool block 1 (the system prompt's took
    # block 0); the store below must name exactly it.
    pool = (1,)
    # Step 1: the document's child is new, 4 of its 6 tokens in paged block 7.
    new = SimpleNamespace(
        req_id=doc_child.request_id, block_ids=([7],), num_computed_tokens=0
    )
    out = SimpleNamespace(
        scheduled_new_reqs=[new],
        num_scheduled_tokens={new.req_id: 4},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        preempted_req_ids=None,
    )
    meta = adapter.build_connector_meta(out)
    assert meta.stores == [
        ChildStore(
            block_ids=(7,),
            pool_block_ids=pool,
            first_position=1,
            end_position=4,
            store_start=1,
        )
    ]
    assert stored(meta) == ([7 * BLOCK + 1, 7 * BLOCK + 2, 7 * BLOCK + 3], [16, 17, 18])
    # Step 2: the last 2 tokens, no new block.
    out = SimpleNamespace(
        scheduled_new_reqs=[],
        num_scheduled_tokens={new.req_id: 2},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[new.req_id],
            new_block_ids=[None],
            resumed_req_ids=set(),
            num_computed_tokens=[4],
        ),
        preempted_req_ids=None,
    )
    meta = adapter.build_connector_meta(out)
    assert stored(meta) == ([7 * BLOCK + 4, 7 * BLOCK + 5], [19, 20])


def _doc_read_times_out_with_rows_lent(num_kv_blocks=64):
    """An adapter whose parent [3, 5, 2] is read from the store (every key
    hits): the system segment's read is OK, the document's times out with its
    pool rows lent. Returns (adapter, parent, the document's fetch)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (  # noqa: E501
        CAUSE_TIMEOUT,
        FETCH_OK,
        StoreReport,
    )
    from vllm.v1.core.chunk_store_probe import StoreAnswer, StoreLookup

    adapter = ChunkCacheSchedulerAdapter(
        *make_config(
            num_kv_blocks=num_kv_blocks,
            store="mooncake://127.0.0.1:1?lookup_timeout=600&local_client=none",
        )
    )

    class EveryKeyHits:
        def lookup(self, segment_ids, context_ids, namespace):
            return StoreLookup(StoreAnswer.HIT, content_hash=len(segment_ids))

    adapter.manager.store_probe = EveryKeyHits()
    r = parent("p", [3, 5, 2])
    adapter.on_new_request(r)
    adapter.get_num_new_matched_tokens(r, 0)
    assert adapter.take_internal_requests() == []  # both segments are read
    sys_fetch, doc_fetch = adapter.store.take_step(epoch=0).fetches
    assert (sys_fetch.pool_block_ids, doc_fetch.pool_block_ids) == ((0,), (1,))
    adapter.on_store_report(
        StoreReport(
            outcomes={
                sys_fetch.fetch_id: [FETCH_OK],
                doc_fetch.fetch_id: [CAUSE_TIMEOUT],
            },
            rows_lent={doc_fetch.fetch_id: 1},
        )
    )
    return adapter, r, doc_fetch


def test_a_failed_fetch_whose_rows_are_lent_computes_in_new_blocks_until_returned():
    """Issue 39, finding 9: a rank's store call may still write into a timed-out
    read's pool rows, so the child computing the segment gets other blocks and
    the old ones go to nobody until the rank reported them back."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (  # noqa: E501
        StoreReport,
    )

    adapter, r, doc_fetch = _doc_read_times_out_with_rows_lent()
    (child,) = adapter.take_internal_requests()
    assert child.prompt_token_ids == [SINK, 13, 14, 15, 16, 17]
    assert adapter._children[child.request_id].spec.pool_block_ids == (2,)
    assert adapter.manager.pool.held_by(doc_fetch.fetch_id) == (1,)
    assert adapter.manager.stats().pool_blocks_held == 1
    adapter.on_store_report(StoreReport(rows_returned={doc_fetch.fetch_id: 1}))
    assert adapter.manager.stats().pool_blocks_held == 0
    finish(adapter, child, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert adapter.get_num_new_matched_tokens(r, 0) == (8, False)
    adapter.store.close()


def test_a_failed_fetch_whose_rows_are_lent_waits_for_them_in_a_full_pool():
    """No room for other blocks: the child starts, in the fetch's own blocks,
    only in the step whose report says the rows are back."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (  # noqa: E501
        StoreReport,
    )

    adapter, r, doc_fetch = _doc_read_times_out_with_rows_lent(num_kv_blocks=2)
    assert adapter.manager.pool.num_blocks == 2
    assert adapter.take_internal_requests() == []
    assert not adapter.take_failed_requests()  # nobody refused
    assert adapter.get_num_new_matched_tokens(r, 0) == (None, False)  # still waiting
    adapter.on_store_report(StoreReport(rows_returned={doc_fetch.fetch_id: 1}))
    (child,) = adapter.take_internal_requests()
    assert child.prompt_token_ids == [SINK, 13, 14, 15, 16, 17]
    assert adapter._children[child.request_id].spec.pool_block_ids == (1,)
    finish(adapter, child, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert adapter.get_num_new_matched_tokens(r, 0) == (8, False)
    adapter.store.close()


def _scheduled(*children, block_ids=None):
    """A step's output scheduling `children` as new requests, all their tokens, each in
    its own paged block (7, 8, ...)."""
    new = [
        SimpleNamespace(
            req_id=c.request_id, block_ids=([7 + i],), num_computed_tokens=0
        )
        for i, c in enumerate(children)
    ]
    return SimpleNamespace(
        scheduled_new_reqs=new,
        num_scheduled_tokens={c.request_id: len(c.prompt_token_ids) for c in children},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        preempted_req_ids=None,
    )


def _puts_and_writes_are_disjoint(meta):
    """The step's puts read pool blocks that none of its stores (new child rows)
    writes."""
    put = {b for p in meta.store.puts for b in p.pool_block_ids}
    written = {b for s in meta.stores for b in s.pool_block_ids}
    assert not put & written, (
        f"pool block(s) {sorted(put & written)} are both copied into a put and written "
        f"by a child in one step (puts {[p.pool_block_ids for p in meta.store.puts]}, "
        f"stores {[s.pool_block_ids for s in meta.stores]})"
    )


def test_a_put_never_copies_rows_a_child_writes_in_the_same_step():
    """Issue 50, finding 3: on vLLM 0.32 a step with no synchronous load copies its
    puts after the forward. A finished child's entry E1 (its parent aborted, so only the
    writer pinned it) was unpinned in the update that queued its put; a failed fetch
    with lent rows in the same update relocated into E1's evicted block, and the next
    step both wrote that block (the new child) and copied it under E1's key. Every block
    a step's puts read must be out of its writes; the parent is still served."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (  # noqa: E501
        CAUSE_TIMEOUT,
        StoreReport,
    )
    from vllm.v1.core.chunk_store_probe import StoreAnswer, StoreLookup

    adapter = ChunkCacheSchedulerAdapter(
        *make_config(
            num_kv_blocks=3,
            store="mooncake://127.0.0.1:1?lookup_timeout=600&local_client=none",
        )
    )
    assert adapter.manager.pool.num_blocks == 3

    class StoreHoldsDocumentFrom30:
        def lookup(self, segment_ids, context_ids, namespace):
            if segment_ids[0] == 30:
                return StoreLookup(StoreAnswer.HIT, content_hash=30)
            return StoreLookup(StoreAnswer.MISS)

    adapter.manager.store_probe = StoreHoldsDocumentFrom30()
    p1 = parent("p1", [3, 5, 2])  # system 10-12, document 13-17
    p2 = Request(
        "p2",
        [10, 11, 12] + list(range(30, 35)) + [40, 41],
        SamplingParams(max_tokens=2),
        None,
        chunk_layout=[3, 5, 2],
    )
    for p in (p1, p2):
        adapter.on_new_request(p)
        adapter.get_num_new_matched_tokens(p, 0)
    sys_child, c1 = (
        adapter.take_internal_requests()
    )  # p2 joins the system, reads its doc
    meta = adapter.build_connector_meta(_scheduled(sys_child, c1))
    (fetch,) = meta.store.fetches
    assert adapter.manager.pool.num_free_blocks == 0
    # The update after that step: p1 was aborted, both children finished (C1's put is
    # queued, its entry now pinned by nobody), and the read of p2's document timed out
    # with its rows lent.
    finish(adapter, p1, RequestStatus.FINISHED_ABORTED)
    finish(adapter, sys_child, RequestStatus.FINISHED_LENGTH_CAPPED)
    finish(adapter, c1, RequestStatus.FINISHED_LENGTH_CAPPED)
    adapter.on_store_report(
        StoreReport(
            outcomes={fetch.fetch_id: [CAUSE_TIMEOUT]}, rows_lent={fetch.fetch_id: 1}
        )
    )
    steps = 0
    while not is_ready(adapter.manager, "p2"):
        steps += 1
        assert steps < 5, "p2 never became ready"
        children = adapter.take_internal_requests()
        meta = adapter.build_connector_meta(_scheduled(*children))
        _puts_and_writes_are_disjoint(meta)
        for c in children:
            finish(adapter, c, RequestStatus.FINISHED_LENGTH_CAPPED)
        adapter.on_store_report(StoreReport(rows_returned={fetch.fetch_id: 1}))
    assert adapter.get_num_new_matched_tokens(p2, 0) == (8, False)
    adapter.store.close()
