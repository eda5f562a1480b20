# SPDX-License-Identifier: Apache-2.0
"""vLLM's own Scheduler (patch 0012) with the chunk cache's connector and no engine:
the model runner's part is played by `ModelRunnerOutput`s, as vLLM's scheduler tests
do, so what is checked is the scheduler's and the connector's real bookkeeping.

Issue 30, finding 2: a running request whose prefill gap (boundary recompute) was
allocated and then preempted in the same step (priority policy, KV pressure) has its
load dropped; the gap's blocks, whose hashes the allocation committed, must not stay in
the prefix cache, where the next request with the same prompt would hit unwritten KV.
"""

from __future__ import annotations

import pytest

from tests.conftest import models_dir
from tests.unit.v1.core.hook_transcript import engine_step

BLOCK = 16
K = 2  # --chunk-recompute-tokens
# system 16 | doc1 40 | doc2 40 | question 8: load 16, compute doc1[:2], load doc1[2:],
# compute doc2[:2], load doc2[2:], compute the question.
LAYOUT = (16, 40, 40, 8)


@pytest.fixture(params=["steps"])
def scheduler(request, monkeypatch):
    """VLLM's Scheduler with the chunk cache; `request.param` "steps": one
    computed stretch per step (the path on every platform but the CPU backend),
    "one": every stretch in one step (query runs, docs/design/boundary-recompute.md)."""
    monkeypatch.setenv(
        "CHUNK_CACHE_RECOMPUTE_ONE_STEP", "0" if request.param == "steps" else "1"
    )
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    config = EngineArgs(
        model=str(models_dir() / "tiny-llama"),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        enable_chunk_cache=True,
        chunk_recompute_tokens=K,
        scheduling_policy="priority",
        enable_prefix_caching=True,
        # Room in the chunk pool (carved out of the KV budget) for the three segments.
        chunk_pool_fraction=0.5,
    ).create_engine_config()
    config.cache_config.block_size = BLOCK
    config.cache_config.num_gpu_blocks = 10
    if request.param == "one-full-graphs":
        # vLLM's default mode on CUDA, with a 4-row FlashAttention 3 buffer
        # (max(max_num_seqs, largest capture size)): a step's runs must fit it.
        from vllm.config.compilation import CUDAGraphMode

        config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        config.compilation_config.max_cudagraph_capture_size = 4
        config.scheduler_config.max_num_seqs = 4
    init_none_hash(sha256)
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32
    )
    # 10 blocks: the null block and 9 for requests (see the test).
    kv_cache_config = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )
    return Scheduler(
        config,
        kv_cache_config,
        StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=False,
    )


def request(rid, token_ids, priority, layout=None):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(
        rid,
        token_ids,
        SamplingParams(max_tokens=8, ignore_eos=True),
        None,
        priority=priority,
        chunk_layout=layout,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


step = engine_step


def test_a_gap_dropped_by_a_preemption_leaves_no_hashed_block_unwritten(scheduler):
    prompt = list(range(100, 100 + sum(LAYOUT)))
    a = request("a", prompt, priority=1, layout=LAYOUT)
    scheduler.add_request(a)
    assert step(scheduler).num_scheduled_tokens == {}  # a waits; its children spawn
    out = step(scheduler)  # the three children prefill (and finish: max_tokens=1)
    assert sorted(out.num_scheduled_tokens.values()) == [16, 1 + 40, 1 + 40]
    assert list(scheduler.requests) == ["a"]

    out = step(scheduler)  # a: system loaded, doc1's head computed
    assert out.num_scheduled_tokens == {"a": K} and a.num_computed_tokens == 16 + K
    b = request("b", list(range(300, 300 + 2 * BLOCK)), priority=0)
    scheduler.add_request(b)
    out = step(scheduler)  # a: doc1's rest loaded, doc2's head computed; b prefills
    assert out.num_scheduled_tokens == {"a": K, "b": 2 * BLOCK}
    assert [load.stretches[0].num_rows for load in out.kv_connector_metadata.loads] == [
        38
    ]
    written = 16 + K + 38 + K  # every position of a whose KV exists now
    assert a.num_computed_tokens == written

    # a's last gap (doc2's rest) is allocated with the question (7 blocks in all), then
    # b's decode needs a 10th block: a, of lower priority, is preempted in this step.
    out = step(scheduler)
    assert out.preempted_req_ids == {"a"} and list(out.num_scheduled_tokens) == ["b"]
    assert out.kv_connector_metadata.loads == []  # the connector dropped a's load

    # The same prompt again: vLLM's prefix cache may offer only the blocks a wrote.
    again = request("again", prompt, priority=0, layout=LAYOUT)
    num_hit = scheduler.kv_cache_manager.get_computed_blocks(again)[1]  # tokens hit
    assert num_hit == written // BLOCK * BLOCK, (
        f"prefix-cache hit of {num_hit} tokens; only {written} were ever written"
    )


@pytest.mark.parametrize("scheduler", ["one"], indirect=True)
def test_every_head_and_the_question_are_one_step_of_query_runs(scheduler):
    """The one-step path on the real scheduler: the waiting request's first step
    allocates every rest as external tokens, schedules both heads and the question
    (2 + 2 + 8 tokens) and lists their query runs; the connector loads the system
    segment and both rests (16 + 38 + 38 rows) in that step."""
    prompt = list(range(100, 100 + sum(LAYOUT)))
    a = request("a", prompt, priority=0, layout=LAYOUT)
    scheduler.add_request(a)
    step(scheduler)  # a waits; its children spawn
    step(scheduler)  # the children prefill
    out = step(scheduler)
    assert out.num_scheduled_tokens == {"a": K + K + 8}
    assert out.query_runs == {"a": ((16, K), (56, K), (96, 8))}
    rows = [
        s.num_rows for load in out.kv_connector_metadata.loads for s in load.stretches
    ]
    assert rows == [16, 38, 38]
    assert a.num_computed_tokens == sum(LAYOUT)


@pytest.mark.parametrize("scheduler", ["one-full-graphs"], indirect=True)
def test_runs_that_would_overflow_the_attention_rows_wait_for_the_next_step(scheduler):
    """Issue 60: under full-graph modes a step has at most 4 attention rows here. a's
    step holds 3 requests (a, b, c: one row each), so a takes 2 of its 3 runs; its
    question (and the rest loaded before it) comes in the next step."""
    prompt = list(range(100, 100 + sum(LAYOUT)))
    a = request("a", prompt, priority=0, layout=LAYOUT)
    scheduler.add_request(a)
    step(scheduler)  # a waits; its children spawn
    step(scheduler)  # the children prefill
    b = request("b", list(range(300, 308)), priority=0)
    c = request("c", list(range(400, 408)), priority=0)
    scheduler.add_request(b)
    scheduler.add_request(c)
    out = step(scheduler)
    assert out.num_scheduled_tokens == {"a": K + K, "b": 8, "c": 8}
    assert out.query_runs == {"a": ((16, K), (56, K))}
    rows = len(out.num_scheduled_tokens) + sum(
        len(r) - 1 for r in out.query_runs.values()
    )
    assert rows <= 4
    assert [
        s.num_rows for load in out.kv_connector_metadata.loads for s in load.stretches
    ] == [16, 38]
    assert a.num_computed_tokens == 16 + K + 38 + K
    out = step(scheduler)  # doc2's rest loaded, the question computed: one run
    assert out.num_scheduled_tokens["a"] == 8 and out.query_runs is None
    assert a.num_computed_tokens == sum(LAYOUT)
