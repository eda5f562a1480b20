# SPDX-License-Identifier: Apache-2.0
"""One step or one per head: decided once at start-up, refused by name where asked
for and not supported (recompute_step.py)."""

from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.recompute_step import (
    RECOMPUTE_IN_ONE_STEP,
    RecomputeSteps,
)
from vllm.platforms import current_platform


def config(k=5, speculative=None, mla=False):
    return SimpleNamespace(
        chunk_cache_config=SimpleNamespace(chunk_recompute_tokens=k),
        model_config=SimpleNamespace(use_mla=mla),
        speculative_config=speculative,
        use_v2_model_runner=False,
    )


@pytest.mark.skipif(not current_platform.is_cpu(), reason="the CPU platform's rule")
def test_the_cpu_backend_takes_every_head_in_one_step(monkeypatch):
    monkeypatch.delenv(RECOMPUTE_IN_ONE_STEP, raising=False)
    assert RecomputeSteps.for_config(config()).one_step
    monkeypatch.setenv(RECOMPUTE_IN_ONE_STEP, "1")
    assert RecomputeSteps.for_config(config()).one_step


def test_what_keeps_or_refuses_the_one_step_path_is_named(monkeypatch):
    monkeypatch.delenv(RECOMPUTE_IN_ONE_STEP, raising=False)
    assert not RecomputeSteps.for_config(config(k=0)).one_step
    mla = RecomputeSteps.for_config(config(mla=True))
    assert not mla.one_step and "MLA" in mla.reason
    spec = RecomputeSteps.for_config(config(speculative=object()))
    assert not spec.one_step and "speculative decoding" in spec.reason
    monkeypatch.setenv(RECOMPUTE_IN_ONE_STEP, "0")
    off = RecomputeSteps.for_config(config())
    assert not off.one_step and "CHUNK_CACHE_RECOMPUTE_ONE_STEP=0" in off.reason
    monkeypatch.setenv(RECOMPUTE_IN_ONE_STEP, "1")
    with pytest.raises(ValueError, match="speculative decoding"):
        RecomputeSteps.for_config(config(speculative=object()))
    monkeypatch.setenv(RECOMPUTE_IN_ONE_STEP, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        RecomputeSteps.for_config(config())


def _platform(kind: str):
    return SimpleNamespace(
        is_cpu=lambda: kind == "cpu", is_cuda=lambda: kind == "cuda", device_name=kind
    )


def test_on_cuda_one_step_is_opt_in_and_elsewhere_refused_by_name(monkeypatch):
    """Issue 40, deliverable 3: on CUDA the one-step path is offered only when asked
    for (=1: not yet shown exact on a GPU); unset, each head takes its step and the
    start-up line says how to opt in. Other platforms (ROCm, XPU, NPU) keep the
    multi-step path, and =1 there is refused naming the platform."""
    monkeypatch.delenv(RECOMPUTE_IN_ONE_STEP, raising=False)
    cuda = RecomputeSteps.for_config(config(), _platform("cuda"))
    assert not cuda.one_step and f"{RECOMPUTE_IN_ONE_STEP}=1" in cuda.reason
    other = RecomputeSteps.for_config(config(), _platform("rocm"))
    assert not other.one_step and "not on rocm" in other.reason
    monkeypatch.setenv(RECOMPUTE_IN_ONE_STEP, "1")
    assert RecomputeSteps.for_config(config(), _platform("cuda")).one_step
    assert RecomputeSteps.for_config(config(), _platform("cpu")).one_step
    with pytest.raises(ValueError, match="not on rocm"):
        RecomputeSteps.for_config(config(), _platform("rocm"))
    # Opted in, what no backend's rows allow is still refused by name.
    with pytest.raises(ValueError, match="MLA"):
        RecomputeSteps.for_config(config(mla=True), _platform("cuda"))


def test_on_cuda_the_worker_refuses_other_backends_full_graph_and_spec_decode_by_name():
    """Issue 60: only what cannot work is refused; vLLM's default FULL_AND_PIECEWISE
    (full graphs for uniform decode batches only) and FULL_DECODE_ONLY are accepted,
    and the start-up line says how a step with runs runs (vLLM's dispatcher itself:
    tests/unit/v1/worker/test_query_runs_dispatch.py)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
        check_query_runs,
    )

    def layer(impl: str):
        return SimpleNamespace(impl=type(impl, (), {})())

    def graphs(mode):
        return SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=128)

    flash = {
        "model.layers.0.self_attn.attn": layer("FlashAttentionImpl"),
        "model.layers.1.self_attn.attn": layer("TritonAttentionImpl"),
    }
    piecewise = graphs(CUDAGraphMode.PIECEWISE)
    line = check_query_runs(True, flash, piecewise, _platform("cuda"))
    assert "runs PIECEWISE (eager above 128 tokens)" in line and "capped" not in line
    assert "eager (no CUDA graphs)" in check_query_runs(
        True, flash, graphs(CUDAGraphMode.NONE), _platform("cuda")
    )
    default = check_query_runs(
        True,
        flash,
        graphs(CUDAGraphMode.FULL_AND_PIECEWISE),
        _platform("cuda"),
        None,
        256,
    )
    assert (
        "cudagraph_mode=FULL_AND_PIECEWISE: a step with query runs runs PIECEWISE"
        in default
    )
    assert "rows capped at 256 per step" in default
    decode_only = check_query_runs(
        True, flash, graphs(CUDAGraphMode.FULL_DECODE_ONLY), _platform("cuda"), None, 64
    )
    assert "runs eager" in decode_only and "rows capped at 128 per step" in decode_only
    # Not asked for, or not CUDA (the CPU backend's rows are its own): nothing to
    # refuse.
    flashinfer = {"model.layers.0.self_attn.attn": layer("FlashInferImpl")}
    assert check_query_runs(False, flashinfer, piecewise, _platform("cuda")) is None
    assert (
        check_query_runs(
            True,
            {"l": layer("CPUAttentionBackendImpl")},
            graphs(CUDAGraphMode.FULL),
            _platform("cpu"),
        )
        is None
    )
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.self_attn\.attn runs FlashInferImpl"
    ):
        check_query_runs(True, flashinfer, piecewise, _platform("cuda"))
    with pytest.raises(
        ValueError,
        match="cudagraph_mode=FULL: it replays a full CUDA graph "
        "for mixed prefill-decode batches",
    ):
        check_query_runs(True, flash, graphs(CUDAGraphMode.FULL), _platform("cuda"))
    with pytest.raises(ValueError, match="does not support speculative decoding"):
        check_query_runs(
            True,
            flash,
            graphs(CUDAGraphMode.FULL_AND_PIECEWISE),
            _platform("cuda"),
            object(),
        )
