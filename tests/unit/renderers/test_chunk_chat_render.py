# SPDX-License-Identifier: Apache-2.0
"""A chat request through vLLM's own renderer (patch 0015), built from the real config
of SmolLM2 as the server builds it, with the request's own `build_chat_params` /
`build_tok_params`, no engine: what `split_chunks` and marked documents do to the
prompt and to the conversation the server echoes (issue 30, finding 4). The oracle is
the renderer of a server without the chunk cache (stock vLLM)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.conftest import models_dir

MODEL = str(models_dir() / "SmolLM2-135M-Instruct")
DOCS = [
    {"title": "Paris", "text": "The Eiffel Tower is in Paris."},
    {"title": "Berlin", "text": "The Brandenburg Gate is in Berlin."},
]
PRIVATE = {chr(c) for c in range(0xE000, 0xE004)}


@pytest.fixture(scope="module")
def renderers():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.registry import renderer_from_config

    def make(chunk_cache):
        config = EngineArgs(
            model=MODEL,
            dtype="float32",
            enforce_eager=True,
            max_model_len=2048,
            enable_chunk_cache=chunk_cache,
        ).create_engine_config()
        return config, renderer_from_config(config)

    # NOTE: one event loop for the module: the renderers' async tokenizers bind to it.
    loop = asyncio.new_event_loop()
    yield {"chunk cache": make(True), "stock": make(False), "loop": loop}
    for task in asyncio.all_tasks(loop):  # the async tokenizers' batching loops
        task.cancel()
    loop.run_until_complete(asyncio.sleep(0))  # let them take the cancellation
    loop.close()


def render(renderers, which, body, use_async):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    config, renderer = renderers[which]
    request = ChatCompletionRequest(model="m", **body)
    # As the server's preprocess_chat builds them (an HF tokenizer: text, not ids).
    chat_params = request.build_chat_params(None, "auto").with_defaults(
        {"tokenize": False}
    )
    args = (
        [request.messages],
        chat_params,
        request.build_tok_params(config.model_config),
    )
    if use_async:
        conversations, prompts = renderers["loop"].run_until_complete(
            renderer.render_chat_async(*args)
        )
    else:
        conversations, prompts = renderer.render_chat(*args)
    return conversations[0], prompts[0]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_split_chunks_false_serves_a_chat_with_documents_as_stock_vllm(
    renderers, use_async
):
    """Before: a 400 ("this model's chat template does not render 'documents'") where
    stock vLLM answers: the documents were marked whatever the request asked."""
    body = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Where is the tower? ## Paris."},
        ],
        "documents": DOCS,
        "split_chunks": False,
    }
    conv, prompt = render(renderers, "chunk cache", body, use_async)
    stock_conv, stock = render(renderers, "stock", body, use_async)
    assert prompt["prompt_token_ids"] == stock["prompt_token_ids"]
    assert prompt.get("chunk_layout") is None
    assert conv == stock_conv
    # Parts marked as chunks are plain text too (the key is the chunk cache's only).
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Doc one.", "chunk": True},
                    {"type": "text", "text": "Where?"},
                ],
            }
        ],
        "split_chunks": False,
    }
    _, prompt = render(renderers, "chunk cache", parts, use_async)
    _, stock = render(renderers, "stock", parts, use_async)
    assert prompt["prompt_token_ids"] == stock["prompt_token_ids"]
    assert prompt.get("chunk_layout") is None


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_the_conversation_given_back_carries_no_marker(renderers, use_async):
    """Before: the conversation the server echoes (`echo: true`) held the private-use
    markers around every part marked as a chunk."""
    body = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "The tower is in Paris.", "chunk": True},
                    {"type": "text", "text": "Where is the tower?"},
                ],
            },
        ],
        "echo": True,
    }
    conv, prompt = render(renderers, "chunk cache", body, use_async)
    assert prompt["chunk_layout"] is not None  # served as chunks
    stock_conv, stock = render(renderers, "stock", body, use_async)
    assert not PRIVATE & set(json.dumps(conv, ensure_ascii=False)), conv
    assert conv == stock_conv
    # The chunks' tokens are the stock prompt's tokens.
    assert prompt["prompt_token_ids"] == stock["prompt_token_ids"]
