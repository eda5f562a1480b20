# SPDX-License-Identifier: Apache-2.0
"""One step or one per head: decided once at start-up, refused by name where asked
for and not supported (recompute_step.py)."""

from types import SimpleNamespace

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.recompute_step import (
    RecomputeSteps,
)
from vllm.platforms import current_platform


def config(k=5, extra=None, speculative=None):
    return SimpleNamespace(
        chunk_cache_config=SimpleNamespace(chunk_recompute_tokens=k),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra or {}),
        speculative_config=speculative, use_v2_model_runner=False)


@pytest.mark.skipif(not current_platform.is_cpu(), reason="the CPU platform's rule")
def test_the_cpu_backend_takes_every_head_in_one_step():
    assert RecomputeSteps.for_config(config()).one_step
    assert RecomputeSteps.for_config(config(extra={"recompute_in_one_step": True})).one_step


def test_what_keeps_or_refuses_the_one_step_path_is_named():
    assert not RecomputeSteps.for_config(config(k=0)).one_step
    off = RecomputeSteps.for_config(config(extra={"recompute_in_one_step": False}))
    assert (off.one_step, off.reason) == (False, "recompute_in_one_step=false")
    spec = RecomputeSteps.for_config(config(speculative=object()))
    assert not spec.one_step and "speculative decoding" in spec.reason
    with pytest.raises(ValueError, match="speculative decoding"):
        RecomputeSteps.for_config(config(extra={"recompute_in_one_step": True},
                                         speculative=object()))
    with pytest.raises(ValueError, match="must be true or false"):
        RecomputeSteps.for_config(config(extra={"recompute_in_one_step": "yes"}))
