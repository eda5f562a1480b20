# SPDX-License-Identifier: Apache-2.0
"""Issue 60, deliverable 1: a step with query runs under CUDA graphs, decided by vLLM's
own code on the CPU (no GPU: the dispatcher and the runner's methods are host code).

* vLLM's `CudagraphDispatcher`, keyed as the model runner keys it, decides a runs
  step's mode (the runner's own `_is_uniform_decode` says whether the batch is a
  uniform decode): under every mode `support.check_query_runs` accepts, such a step
  never gets a full graph; under the one it refuses (FULL), it does. The runner's
  `check_runs_dispatch` refuses exactly the full-graph dispatch.
* Cascade attention (vLLM 0.23's runner): a step with runs inside a shared prefix
  takes none (its prefix pass is not causal). vLLM 0.32 removed cascade attention.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    check_query_runs,
)
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.query_runs import check_runs_dispatch, run_rows

CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
MAX_NUM_SEQS = 64


def _dispatcher(mode: CUDAGraphMode) -> CudagraphDispatcher:
    """VLLM's dispatcher for `mode` with a stand-in engine config (what it reads)."""
    compilation = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=mode,
        cudagraph_capture_sizes=list(CAPTURE_SIZES),
        max_cudagraph_capture_size=CAPTURE_SIZES[-1],
    )
    # vLLM's default splitting ops (attention outside the piecewise graphs).
    compilation.set_splitting_ops_for_v1("allgather_reducescatter")
    config = SimpleNamespace(
        compilation_config=compilation,
        speculative_config=None,
        num_speculative_tokens=0,
        lora_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
    )
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(mode, 1)
    return dispatcher


def _dispatch(dispatcher: CudagraphDispatcher, scheduled: list[int]) -> CUDAGraphMode:
    """The runtime mode the V1 runner's _determine_batch_execution_and_padding gets."""
    uniform = GPUModelRunner._is_uniform_decode(
        max_num_scheduled_tokens=max(scheduled),
        uniform_decode_query_len=1,
        num_tokens=sum(scheduled),
        num_reqs=len(scheduled),
    )
    mode, _ = dispatcher.dispatch(num_tokens=sum(scheduled), uniform_decode=uniform)
    return mode


def _platform():
    return SimpleNamespace(
        is_cpu=lambda: False, is_cuda=lambda: True, device_name="cuda"
    )


def _layers():
    return {
        "model.layers.0.self_attn.attn": SimpleNamespace(
            impl=type("FlashAttentionImpl", (), {})()
        )
    }


# Steps with runs: a request with runs has >= 2 scheduled tokens (>= 2 runs of >= 1);
# others decode (1) or prefill. Up to and above the largest capture size (128).
RUNS_STEPS = [
    [2],
    [1, 2],
    [1] * 6 + [2],
    [3, 1, 1, 1],
    [12, 12, 8],
    [1] * 30 + [40],
    [1] * 63 + [65],
    [100],
    [240],
    [1] * 20 + [200],
]


@pytest.mark.parametrize(
    "mode", [m for m in CUDAGraphMode if m != CUDAGraphMode.NONE], ids=lambda m: m.name
)
def test_vllm_dispatcher_gives_a_runs_step_no_full_graph_where_one_step_is_accepted(
    mode,
):
    dispatcher = _dispatcher(mode)
    modes = {tuple(s): _dispatch(dispatcher, s) for s in RUNS_STEPS}
    config = SimpleNamespace(
        cudagraph_mode=mode, max_cudagraph_capture_size=CAPTURE_SIZES[-1]
    )
    if mode == CUDAGraphMode.FULL:
        with pytest.raises(ValueError, match="cudagraph_mode=FULL: it replays a full"):
            check_query_runs(True, _layers(), config, _platform())
        assert CUDAGraphMode.FULL in modes.values(), modes
        return
    line = check_query_runs(True, _layers(), config, _platform(), None, MAX_NUM_SEQS)
    assert f"cudagraph_mode={mode.name}" in line
    assert CUDAGraphMode.FULL not in modes.values(), modes
    for scheduled, got in modes.items():
        # The runner's check agrees: what the dispatcher gave passes.
        check_runs_dispatch(_rows(list(scheduled)), got)
        if sum(scheduled) > CAPTURE_SIZES[-1] or mode == CUDAGraphMode.FULL_DECODE_ONLY:
            assert got == CUDAGraphMode.NONE, (scheduled, got)
        else:
            assert got == CUDAGraphMode.PIECEWISE, (scheduled, got)
    if mode.has_full_cudagraphs():
        # Not vacuous: the same dispatcher replays full graphs for decode batches.
        assert _dispatch(dispatcher, [1] * 8) == CUDAGraphMode.FULL
        assert f"rows capped at {max(MAX_NUM_SEQS, CAPTURE_SIZES[-1])}" in line


def _rows(scheduled: list[int]):
    """The attention rows of a step whose last request (>= 2 tokens) has two runs."""
    ids = [f"r{i}" for i in range(len(scheduled))]
    last = scheduled[-1]
    runs = {ids[-1]: ((3, 1), (100, last - 1))}
    # The last run ends where the request's sequence ends: 99 + last.
    computed = np.array([50] * (len(scheduled) - 1) + [99])
    num = np.array(scheduled)
    return run_rows(runs, ids, num, computed + num)


def test_the_runner_refuses_a_full_graph_for_a_step_with_runs_by_name():
    rows = _rows([1, 1, 5])
    assert rows.num_rows == 4
    with pytest.raises(
        RuntimeError, match=r"4 attention rows for 3 requests.*mode FULL"
    ):
        check_runs_dispatch(rows, CUDAGraphMode.FULL)
    for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
        check_runs_dispatch(rows, mode)
    check_runs_dispatch(None, CUDAGraphMode.FULL)  # no runs: vLLM's own business


class _Runner:
    """The V1 runner's cascade decision, vLLM's code, over a stand-in runner state."""

    _compute_cascade_attn_prefix_lens = getattr(
        GPUModelRunner, "_compute_cascade_attn_prefix_lens", None
    )
    _compute_cascade_attn_prefix_len = getattr(
        GPUModelRunner, "_compute_cascade_attn_prefix_len", None
    )


def test_a_step_with_runs_inside_a_shared_prefix_takes_no_cascade_attention():
    if _Runner._compute_cascade_attn_prefix_lens is None:
        # vLLM 0.32 removed cascade attention from the V1 runner: nothing to turn off.
        assert not hasattr(GPUModelRunner, "_compute_cascade_attn_prefix_len")
        return
    from vllm.v1.attention.backends import flash_attn
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    builder = SimpleNamespace(use_cascade_attention=flash_attn.use_cascade_attention)
    runner = _Runner()
    runner.kv_cache_config = SimpleNamespace(kv_cache_groups=[object()])
    runner.attn_groups = [
        [SimpleNamespace(kv_cache_spec=spec, get_metadata_builder=lambda: builder)]
    ]
    runner.num_query_heads, runner.use_alibi, runner.num_sms = 8, False, 132
    runner.dcp_world_size = 1
    # 8 requests share a 40-block (640-token) prefix; each has computed >= 600 tokens.
    # Request 0 is a runs step: heads at 5 and 300 (inside the prefix), question at 700.
    scheduled = np.array([2 + 2 + 4] + [3] * 7)
    computed = np.array([704 - 8] + [600 + i for i in range(7)])
    runs = {"r0": ((5, 2), (300, 2), (700, 4))}
    ids = [f"r{i}" for i in range(8)]
    runner._query_run_rows = None
    # Without runs vLLM takes cascade here (the prefix, cut to the least computed, 592).
    plain = _Runner._compute_cascade_attn_prefix_lens(runner, scheduled, computed, [40])
    assert plain == [[592]]
    runner._query_run_rows = run_rows(runs, ids, scheduled, computed + scheduled)
    # With runs it must not: the head at 5 would attend to the prefix's keys up to 592.
    assert (
        _Runner._compute_cascade_attn_prefix_lens(runner, scheduled, computed, [40])
        is None
    )
