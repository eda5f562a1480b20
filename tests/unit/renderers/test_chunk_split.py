# SPDX-License-Identifier: Apache-2.0
"""Renderer glue of the chunk cache (vllm/renderers/chunk_split.py): the layout
salt round trip and the split hooks, with a real (offline) tokenizer."""

from types import SimpleNamespace

import pytest

from vllm.config import ChunkCacheConfig
from vllm.renderers.chunk_split import (
    ChunkPromptError,
    ChunkPromptSplitter,
    chunked_prompt_from_salt,
    decode_layout_salt,
    encode_layout_salt,
    validate_chunked_request,
)
from tests.unit.conftest import build_toy_tokenizer


def _splitter(**kw):
    return ChunkPromptSplitter(SimpleNamespace(
        chunk_cache_config=ChunkCacheConfig(enable_chunk_cache=True, **kw)))


def _params(add_special_tokens=True, truncate=None):
    return SimpleNamespace(add_special_tokens=add_special_tokens,
                           truncate_prompt_tokens=truncate)


@pytest.mark.parametrize("user", [None, "", "tenant/with/slashes", "="])
def test_layout_salt_round_trip(user):
    salt = encode_layout_salt([3, 10, 1], user)
    assert decode_layout_salt(salt) == ([3, 10, 1], user)


@pytest.mark.parametrize("salt", [None, "", "user salt", "vllm-chunk-cache/v1/x/-",
                                  "vllm-chunk-cache/v1/1,2/nouser"])
def test_other_salts_are_not_layouts(salt):
    assert decode_layout_salt(salt) is None


def test_inconsistent_layout_is_served_as_a_normal_request():
    assert chunked_prompt_from_salt([1, 2, 3], encode_layout_salt([1, 1], None)) is None
    prompt, user = chunked_prompt_from_salt([1, 2, 3], encode_layout_salt([1, 2], "u"))
    assert [s.num_tokens for s in prompt.spans] == [1, 2] and user == "u"


def test_text_split_tokenizes_per_segment_with_special_tokens_first_only():
    tok = build_toy_tokenizer()
    out = _splitter().split_text({"prompt": "system ## doc one ## question"},
                                 _params(), tok)
    expected = (tok.encode("system") + tok.encode("doc one", add_special_tokens=False)
                + tok.encode("question", add_special_tokens=False))
    assert out["prompt_token_ids"] == expected
    lengths, user = decode_layout_salt(out["cache_salt"])
    assert sum(lengths) == len(expected) and user is None
    # A chat template renders its own special tokens: none are added then.
    out = _splitter().split_text({"prompt": "system ## q"}, _params(False), tok)
    assert out["prompt_token_ids"][0] != tok.bos_token_id


def test_prompt_without_separator_is_untouched():
    tok = build_toy_tokenizer()
    assert _splitter().split_text({"prompt": "no marker"}, _params(), tok) is None
    prompt = {"prompt_token_ids": [1, 2, 3]}
    assert _splitter().split_token_ids(prompt, tok) is prompt


def test_token_ids_split_on_the_separator_ids():
    tok = build_toy_tokenizer()
    sep = tok.encode("##", add_special_tokens=False)
    out = _splitter().split_token_ids({"prompt_token_ids": [5, 6] + sep + [7] + sep + [8]},
                                      tok)
    assert out["prompt_token_ids"] == [5, 6, 7, 8]
    assert decode_layout_salt(out["cache_salt"])[0] == [2, 1, 1]


@pytest.mark.parametrize("prompt,message", [
    ("a ## ## b", "segment 1 is empty"),
    ("a ## b ## c ## d", "more than max_chunks=1"),
])
def test_bad_prompts_raise_a_named_error(prompt, message):
    with pytest.raises(ChunkPromptError, match=message):
        _splitter(max_chunks=1).split_text({"prompt": prompt}, _params(), build_toy_tokenizer())


def test_reserved_salt_truncation_and_prompt_logprobs_are_refused():
    tok = build_toy_tokenizer()
    with pytest.raises(ChunkPromptError, match="reserved"):
        _splitter().split_text({"prompt": "x", "cache_salt": "vllm-chunk-cache/1"},
                               _params(), tok)
    with pytest.raises(ChunkPromptError, match="truncate_prompt_tokens"):
        _splitter().split_text({"prompt": "a ## b"}, _params(truncate=3), tok)
    salt = encode_layout_salt([1, 1], None)
    with pytest.raises(ChunkPromptError, match="prompt_logprobs"):
        validate_chunked_request(SimpleNamespace(prompt_logprobs=1), salt)
    validate_chunked_request(SimpleNamespace(prompt_logprobs=1), "user salt")


def test_disabled_splitter_does_nothing():
    splitter = ChunkPromptSplitter(SimpleNamespace(chunk_cache_config=ChunkCacheConfig()))
    assert splitter.split_text({"prompt": "a ## b"}, _params(), build_toy_tokenizer()) is None
