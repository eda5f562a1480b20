# SPDX-License-Identifier: Apache-2.0
"""A request the chunk cache refuses reaches its client as an error finish that carries
the connector's reason, on vLLM's own Scheduler with no model: through 0.33's own
RequestError (code "kv_connector_error", retryable), and through the output's
stop_reason on the bases before it (where patch 0013 hands it to the OpenAI layer)."""

from __future__ import annotations

import pytest
from vllm import __version__ as vllm_version

from tests.unit.v1.core.hook_transcript import (
    SchedulerShape,
    engine_step_outputs,
    make_request,
    make_scheduler,
    prompt,
)

SYS = list(range(100, 116))
DOCS = [list(range(200 + 100 * i, 240 + 100 * i)) for i in range(3)]
QUESTION = list(range(600, 640))


def _refused_output(monkeypatch):
    from vllm.v1.engine import FinishReason

    # A pool of 7 blocks: the system prompt and three 40-token documents need 13.
    scheduler = make_scheduler(
        SchedulerShape(num_gpu_blocks=40, pool_fraction=1 / 6, max_batched=32),
        monkeypatch,
    )
    scheduler.add_request(make_request("big", *prompt(SYS, *DOCS, QUESTION)))
    _, to_clients = engine_step_outputs(scheduler)
    outputs = [o for batch in to_clients.values() for o in batch.outputs]
    assert [o.request_id for o in outputs] == ["big"]
    (out,) = outputs
    assert out.finish_reason == FinishReason.ERROR and out.new_token_ids == []
    assert "big" not in scheduler.requests
    return out


@pytest.mark.skipif(
    not vllm_version.startswith("0.33"), reason="vLLM 0.33's RequestError"
)
def test_on_0_33_the_reason_is_the_outputs_retryable_request_error(monkeypatch):
    from vllm.exceptions import RetryableRequestError
    from vllm.outputs import RequestError

    out = _refused_output(monkeypatch)
    assert isinstance(out.error, RequestError)
    assert out.error.code == "kv_connector_error" and out.error.retryable
    assert "the chunk pool has 7 blocks in total" in out.error.message
    assert out.stop_reason is None
    # vLLM's own mapping to what the client is raised.
    raised = out.error.to_exception()
    assert isinstance(raised, RetryableRequestError)
    assert out.error.message in str(raised)


@pytest.mark.skipif(
    vllm_version.startswith("0.33"),
    reason="before 0.33 the reason travels in stop_reason (patch 0013)",
)
def test_before_0_33_the_reason_is_the_outputs_stop_reason(monkeypatch):
    out = _refused_output(monkeypatch)
    assert isinstance(out.stop_reason, str)
    assert "the chunk pool has 7 blocks in total" in out.stop_reason
