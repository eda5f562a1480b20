# SPDX-License-Identifier: Apache-2.0
"""Renderer glue of the chunk cache (vllm/renderers/chunk_split.py): the split
hooks (sync and async), the layout field, and the front-end refusals, with a
real (offline) tokenizer."""

import asyncio
from types import SimpleNamespace

import pytest
from vllm.config import ChunkCacheConfig
from vllm.exceptions import VLLMValidationError
from vllm.renderers.chunk_split import (
    LAYOUT_KEY,
    SEGMENTS_KEY,
    ChunkPromptError,
    ChunkPromptSplitter,
    make_splitter,
    validate_chunked_request,
)

from tests.unit.conftest import build_toy_tokenizer


def _config(**kw):
    return SimpleNamespace(
        chunk_cache_config=ChunkCacheConfig(enable_chunk_cache=True, **kw)
    )


def _splitter(**kw):
    return ChunkPromptSplitter(_config(**kw))


class _Params(SimpleNamespace):
    def apply_pre_tokenization(self, tokenizer, prompt):
        return prompt


def _params(add_special_tokens=True, truncate=None, split_chunks=True):
    return _Params(
        add_special_tokens=add_special_tokens,
        truncate_prompt_tokens=truncate,
        split_chunks=split_chunks,
    )


class _CountingAsyncTokenizer:
    """Stands in for vLLM's AsyncMicrobatchTokenizer: records every call."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    async def encode(self, text, **kwargs):
        self.calls.append((text, kwargs))
        return self.tok.encode(text, **kwargs)


class _NoSyncTokenizer:
    """The sync tokenizer must not be used to encode segments on the async path."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text, add_special_tokens=True):
        raise AssertionError("segment tokenized synchronously on the event loop")


def test_text_split_tokenizes_per_segment_with_special_tokens_first_only():
    tok = build_toy_tokenizer()
    out = _splitter().split({"prompt": "system ## doc one ## question"}, _params(), tok)
    expected = (
        tok.encode("system")
        + tok.encode("doc one", add_special_tokens=False)
        + tok.encode("question", add_special_tokens=False)
    )
    assert out["prompt_token_ids"] == expected
    assert out[LAYOUT_KEY] == [
        len(tok.encode("system")),
        len(expected)
        - len(tok.encode("system"))
        - len(tok.encode("question", add_special_tokens=False)),
        len(tok.encode("question", add_special_tokens=False)),
    ]
    assert "cache_salt" not in out
    # A chat template renders its own special tokens: none are added then.
    out = _splitter().split({"prompt": "system ## q"}, _params(False), tok)
    assert out["prompt_token_ids"][0] != tok.bos_token_id


def test_async_split_uses_the_async_tokenizer_and_gives_the_same_prompt():
    tok = build_toy_tokenizer()
    prompt = {"prompt": "system ## doc one ## doc two ## question", "cache_salt": "t"}
    async_tok = _CountingAsyncTokenizer(tok)
    out = asyncio.run(
        _splitter().split_async(
            prompt, _params(), _NoSyncTokenizer(tok), async_tok.encode
        )
    )
    assert out == _splitter().split(prompt, _params(), tok)
    assert [kw["add_special_tokens"] for _, kw in async_tok.calls] == [
        True,
        False,
        False,
        False,
    ]
    assert out["cache_salt"] == "t"  # the user's salt, untouched


def test_prompt_without_separator_is_untouched():
    tok = build_toy_tokenizer()
    prompt = {"prompt": "no marker"}
    assert _splitter().split(prompt, _params(), tok) is prompt
    prompt = {"prompt_token_ids": [1, 2, 3]}
    assert _splitter().split(prompt, _params(), tok) is prompt


def test_a_request_can_opt_out_of_splitting():
    tok = build_toy_tokenizer()
    prompt = {"prompt": "# Title ## Section ## more"}
    assert _splitter().split(prompt, _params(split_chunks=False), tok) is prompt
    out = asyncio.run(
        _splitter().split_async(
            prompt,
            _params(split_chunks=False),
            tok,
            _CountingAsyncTokenizer(tok).encode,
        )
    )
    assert out is prompt


def test_token_ids_split_on_the_separator_ids():
    tok = build_toy_tokenizer()
    sep = tok.encode("##", add_special_tokens=False)
    out = _splitter().split(
        {"prompt_token_ids": [5, 6] + sep + [7] + sep + [8]}, _params(), tok
    )
    assert out["prompt_token_ids"] == [5, 6, 7, 8]
    assert out[LAYOUT_KEY] == [2, 1, 1]


@pytest.mark.parametrize(
    "prompt,message",
    [
        ("a ## ## b", "segment 1 is empty"),
        ("a ## b ## c ## d", "more than --max-chunks 1"),
    ],
)
def test_bad_prompts_raise_a_validation_error(prompt, message):
    with pytest.raises(ChunkPromptError, match=message) as e:
        _splitter(max_chunks=1).split(
            {"prompt": prompt}, _params(), build_toy_tokenizer()
        )
    # vLLM's own validation-error type: HTTP 400 through its handler, no traceback.
    assert isinstance(e.value, VLLMValidationError)


def test_given_segments_equal_the_separator_split_of_the_same_text():
    """Same tokens and layout (so the same chunk keys) as the separator form,
    sync and async; the `prompt_segments` key is consumed."""
    tok = build_toy_tokenizer()
    by_separator = _splitter().split(
        {"prompt": "system ## doc one ## question"}, _params(), tok
    )
    prompt = {SEGMENTS_KEY: ["system", "doc one", "question"], "cache_salt": "t"}
    out = _splitter().split(prompt, _params(), tok)
    assert out == {
        "prompt_token_ids": by_separator["prompt_token_ids"],
        LAYOUT_KEY: by_separator[LAYOUT_KEY],
        "cache_salt": "t",
    }
    async_tok = _CountingAsyncTokenizer(tok)
    assert (
        asyncio.run(
            _splitter().split_async(
                prompt, _params(), _NoSyncTokenizer(tok), async_tok.encode
            )
        )
        == out
    )
    assert [kw["add_special_tokens"] for _, kw in async_tok.calls] == [
        True,
        False,
        False,
    ]


def test_given_segments_keep_any_text_and_token_ids_as_given():
    tok = build_toy_tokenizer()
    # A document with the separator (and Markdown) in it is one segment.
    doc = "# Title ## Section ##"
    out = _splitter().split({SEGMENTS_KEY: ["sys", doc, "q"]}, _params(), tok)
    assert out[LAYOUT_KEY][1] == len(tok.encode(doc, add_special_tokens=False))
    out = _splitter().split({SEGMENTS_KEY: [[5, 6], [7], [8, 9, 10]]}, _params(), tok)
    assert out["prompt_token_ids"] == [5, 6, 7, 8, 9, 10] and out[LAYOUT_KEY] == [
        2,
        1,
        3,
    ]
    out = asyncio.run(
        _splitter().split_async(
            {SEGMENTS_KEY: [[5, 6], [7], [8]]},
            _params(),
            tok,
            _CountingAsyncTokenizer(tok).encode,
        )
    )
    assert out[LAYOUT_KEY] == [2, 1, 1]


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ({SEGMENTS_KEY: []}, {}, "at least 2 segments"),
        ({SEGMENTS_KEY: ["only one"]}, {}, "at least 2 segments"),
        ({SEGMENTS_KEY: "sys ## q"}, {}, "at least 2 segments"),
        ({SEGMENTS_KEY: ["sys", 3, "q"]}, {}, "strings or a list of token-id lists"),
        ({SEGMENTS_KEY: ["sys", [5], "q"]}, {}, "not a mix"),
        ({SEGMENTS_KEY: [[5], [-1], [6]]}, {}, "non-negative"),
        ({SEGMENTS_KEY: ["sys", "", "q"]}, {}, "segment 1 is empty"),
        (
            {SEGMENTS_KEY: ["sys", "a", "b", "c", "q"]},
            {},
            "3 chunks .* more than --max-chunks 2",
        ),
        (
            {SEGMENTS_KEY: ["sys", "word " * 50, "q"]},
            {},
            "more than --max-chunk-tokens 20",
        ),
        (
            {SEGMENTS_KEY: ["sys", "q"], "prompt": "x"},
            {},
            "cannot be combined with 'prompt'",
        ),
        ({SEGMENTS_KEY: ["sys", "q"]}, {"split_chunks": False}, "split_chunks=false"),
        ({SEGMENTS_KEY: ["sys", "q"]}, {"truncate": 5}, "truncate_prompt_tokens"),
        ({SEGMENTS_KEY: ["sys", "q"], LAYOUT_KEY: [1, 1]}, {}, "may not carry one"),
    ],
)
def test_bad_segments_are_refused_naming_the_field_and_the_limit(
    prompt, params, message
):
    splitter = _splitter(max_chunks=2, max_chunk_tokens=20)
    tok = build_toy_tokenizer()
    with pytest.raises(ChunkPromptError, match=message) as e:
        splitter.split(prompt, _params(**params), tok)
    assert isinstance(e.value, VLLMValidationError)
    with pytest.raises(ChunkPromptError, match=message):
        asyncio.run(
            splitter.split_async(
                prompt, _params(**params), tok, _CountingAsyncTokenizer(tok).encode
            )
        )


def test_a_prompt_may_not_bring_its_own_layout():
    tok = build_toy_tokenizer()
    for prompt in (
        {"prompt": "a ## b", LAYOUT_KEY: [1, 1]},
        {"prompt_token_ids": [5, 6, 7], LAYOUT_KEY: [1, 1, 1]},
    ):
        with pytest.raises(ChunkPromptError, match="may not carry one"):
            _splitter().split(prompt, _params(), tok)


def test_a_salt_is_only_a_salt():
    tok = build_toy_tokenizer()
    salt = "vllm-chunk-cache/v1/3,2,3/=tenantB"
    prompt = {"prompt": "no marker", "cache_salt": salt}
    assert _splitter().split(prompt, _params(), tok) is prompt


def test_truncation_prompt_logprobs_and_an_oversized_pool_request_are_refused():
    tok = build_toy_tokenizer()
    with pytest.raises(ChunkPromptError, match="truncate_prompt_tokens"):
        _splitter().split({"prompt": "a ## b"}, _params(truncate=3), tok)
    config = _config(chunk_context="sink")
    config.cache_config = SimpleNamespace(num_gpu_blocks=None, block_size=16)
    with pytest.raises(ChunkPromptError, match="prompt_logprobs"):
        validate_chunked_request(
            config, SimpleNamespace(prompt_logprobs=1), [1, 2], [1, 1]
        )
    # Pool: 15% of 8 blocks x 16 tokens = 19 rows = 1 block of 16 rows.
    config.cache_config.num_gpu_blocks = 8
    validate_chunked_request(
        config, SimpleNamespace(prompt_logprobs=None), list(range(20)), [16, 4]
    )
    with pytest.raises(ChunkPromptError, match="need 2 chunk pool blocks .* has 1 "):
        validate_chunked_request(
            config, SimpleNamespace(prompt_logprobs=None), list(range(21)), [16, 1, 4]
        )


def test_disabled_chunk_cache_has_no_splitter():
    assert make_splitter(SimpleNamespace(chunk_cache_config=ChunkCacheConfig())) is None


@pytest.mark.parametrize("bad", [[5, True, 6], [5, 6.0], [5, -1], ["5"]])
def test_token_id_segments_are_non_negative_ints_and_nothing_else(bad):
    # bool is an int subclass and 6.0 == 6: both refused, as a JSON client's
    # true or 6.0 would be.
    with pytest.raises(ChunkPromptError, match="non-negative"):
        _splitter().split(
            {SEGMENTS_KEY: [[1], bad, [2]]}, _params(), build_toy_tokenizer()
        )


def test_token_id_segments_run_no_python_per_token():
    """Issue 52: a prompt given as token-id segments is checked, joined and
    marked with no Python loop over its tokens: 50 times the tokens, the same
    Python lines executed."""
    from tests.unit.python_lines import python_lines

    tok = build_toy_tokenizer()
    splitter = _splitter(max_chunk_tokens=100_000)

    def split(doc_tokens):
        segments = [[1, 2]] + [list(range(3, 3 + doc_tokens))] * 4 + [[7, 8]]
        return lambda: splitter.split({SEGMENTS_KEY: segments}, _params(), tok)

    small, large = split(40), split(2000)
    assert len(large()["prompt_token_ids"]) == 4 + 4 * 2000
    small()
    assert python_lines(large) == python_lines(small)
