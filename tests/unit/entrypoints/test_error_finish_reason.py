"""The OpenAI server's answer to a request the engine finished with an error
(patch 0013): the reason the engine gave (the error finish's stop_reason, e.g.
which document the chunk cache could not compute) is the 500's message, on the
completions and chat completions paths; without a reason nothing changes."""

from __future__ import annotations

import importlib

import pytest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

# NOTE: vLLM 0.33 raises a request's error to the client itself (vllm.outputs.
# RequestError); its series has no 0013 and the chunk cache's failures take that path
# (docs/design/bases.md).
pytestmark = pytest.mark.skipif(
    hasattr(importlib.import_module("vllm.outputs"), "RequestError"),
    reason="patch 0013 is not in this base's series: this vLLM raises a request's "
    "error to the client itself (vllm.outputs.RequestError)",
)

REASON = (
    "chunk cache: document 2 of this request (37 tokens, chunk key 0123) could "
    "not be computed (2 attempts); ... retrying the request is safe."
)


def create_error_response(exc: Exception):
    # NOTE: the module moved between the two bases.
    for name in (
        "vllm.entrypoints.serve.utils.error_response",
        "vllm.entrypoints.serve.exception_handling.error_response",
    ):
        try:
            return importlib.import_module(name).create_error_response(exc)
        except ModuleNotFoundError:
            continue
    raise AssertionError("no create_error_response in this vLLM")


@pytest.fixture(
    params=[OpenAIServingCompletion, OpenAIServingChat], ids=["completions", "chat"]
)
def serving(request):
    # _raise_if_error reads no state: an instance without its engine will do.
    return object.__new__(request.param)


def raised(serving, *args) -> Exception:
    with pytest.raises(Exception) as info:
        serving._raise_if_error(*args)
    assert type(info.value).__name__ == "GenerationError"
    return info.value


def test_an_error_with_a_reason_reaches_the_client(serving):
    exc = raised(serving, "error", "cmpl-1", REASON)
    assert str(exc) == f"Internal server error: {REASON}"
    body = create_error_response(exc)
    assert body.error.code == 500 and body.error.message == str(exc)


def test_an_error_without_a_reason_is_unchanged(serving):
    assert str(raised(serving, "error", "cmpl-1")) == "Internal server error"
    assert str(raised(serving, "error", "cmpl-1", None)) == "Internal server error"


@pytest.mark.parametrize(
    "finish_reason, stop_reason",
    [("stop", 2), ("stop", "###"), ("length", None), (None, None)],
)
def test_other_finishes_raise_nothing(serving, finish_reason, stop_reason):
    serving._raise_if_error(finish_reason, "cmpl-1", stop_reason)
