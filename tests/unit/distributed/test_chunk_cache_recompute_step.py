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
    return SimpleNamespace(chunk_cache_config=SimpleNamespace(chunk_recompute_tokens=k),
                           model_config=SimpleNamespace(use_mla=mla),
                           speculative_config=speculative, use_v2_model_runner=False)


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
