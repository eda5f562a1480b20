# SPDX-License-Identifier: Apache-2.0
"""A prompt's `chunk_layout` is the chunk cache's own field: only its splitter sets it.
A prompt that arrives with one is refused with the chunk cache on, and with it off the
layout must not reach the engine: there, it would key the prompt's blocks by a layout
no separator made, and the input processor would check the request as a chunked one.
Through vLLM's own renderer (patch 0003), built from the real config of SmolLM2 as
the server builds it, no engine; the oracle is stock vLLM, whose engine input has no
such field."""

from __future__ import annotations

import pytest

from tests.conftest import models_dir

MODEL = str(models_dir() / "SmolLM2-135M-Instruct")


def make_renderer(chunk_cache: bool):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.registry import renderer_from_config

    config = EngineArgs(
        model=MODEL,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        enable_chunk_cache=chunk_cache,
    ).create_engine_config()
    return renderer_from_config(config)


def test_a_request_s_layout_does_not_reach_the_engine_without_the_chunk_cache():
    """Before: copied into the engine input (an `object` the type checker flagged)."""
    renderer = make_renderer(chunk_cache=False)
    prompt = {"prompt_token_ids": [1, 2, 3, 4], "chunk_layout": [2, 2]}

    (engine_input,) = renderer.render_cmpl([prompt])

    assert engine_input["prompt_token_ids"] == [1, 2, 3, 4]
    assert "chunk_layout" not in engine_input


def test_a_request_s_layout_is_refused_with_the_chunk_cache():
    from vllm.renderers.chunk_split import ChunkPromptError

    renderer = make_renderer(chunk_cache=True)
    prompt = {"prompt_token_ids": [1, 2, 3, 4], "chunk_layout": [2, 2]}

    with pytest.raises(ChunkPromptError, match="may not carry one"):
        renderer.render_cmpl([prompt])
