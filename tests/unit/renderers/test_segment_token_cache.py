# SPDX-License-Identifier: Apache-2.0
"""The front end's segment token cache (vllm/renderers/segment_token_cache.py):
a repeated document is not tokenized again, its ids are those the tokenizer
gives, the question is never kept, tenants (cache_salt) and tokenizers never
share an entry, and the bound holds. Oracle: the real tokenizer's encode of each
segment on its own."""

import asyncio
from types import SimpleNamespace

from vllm.config import ChunkCacheConfig
from vllm.renderers.chunk_split import LAYOUT_KEY, ChunkPromptSplitter
from vllm.renderers.segment_token_cache import SegmentText, SegmentTokenCache

from tests.unit.conftest import build_toy_tokenizer


class _Params(SimpleNamespace):
    def apply_pre_tokenization(self, tokenizer, prompt):
        return prompt


PARAMS = _Params(
    add_special_tokens=True, truncate_prompt_tokens=None, split_chunks=True
)


class _Counting:
    """The real tokenizer, with every encode recorded."""

    def __init__(self, tok):
        self.tok, self.texts = tok, []

    def encode(self, text, add_special_tokens=True):
        self.texts.append(text)
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    async def encode_async(self, text, add_special_tokens=True):
        return self.encode(text, add_special_tokens=add_special_tokens)


def _splitter():
    config = SimpleNamespace(
        chunk_cache_config=ChunkCacheConfig(enable_chunk_cache=True)
    )
    return ChunkPromptSplitter(config)


def _expected(tok, segments):
    return [tok.encode(s, add_special_tokens=i == 0) for i, s in enumerate(segments)]


def _segments_of(out):
    ids, layout, pieces = out["prompt_token_ids"], out[LAYOUT_KEY], []
    for n in layout:
        pieces.append(ids[:n])
        ids = ids[n:]
    return pieces


def test_a_repeated_document_is_tokenized_once_and_gives_the_tokenizers_ids():
    tok = build_toy_tokenizer()
    counting, splitter = _Counting(tok), _splitter()
    first = splitter.split(
        {"prompt": "system ## doc one ## doc two ## q one"}, PARAMS, counting
    )
    assert counting.texts == ["system", "doc one", "doc two", "q one"]
    counting.texts.clear()
    # Another order and question: only the new question is tokenized.
    out = splitter.split(
        {"prompt": "system ## doc two ## doc one ## q two"}, PARAMS, counting
    )
    assert counting.texts == ["q two"]
    assert _segments_of(out) == _expected(
        tok, ["system", "doc two", "doc one", "q two"]
    )
    assert _segments_of(first) == _expected(
        tok, ["system", "doc one", "doc two", "q one"]
    )
    # The question is not kept: asked again, it is tokenized again.
    counting.texts.clear()
    splitter.split({"prompt": "system ## doc one ## q one"}, PARAMS, counting)
    assert counting.texts == ["q one"]


def test_given_segments_and_the_async_path_share_the_entries():
    tok = build_toy_tokenizer()
    counting, splitter = _Counting(tok), _splitter()
    segments = ["system", "doc one", "the question"]
    out = asyncio.run(
        splitter.split_async(
            {"prompt_segments": segments}, PARAMS, counting, counting.encode_async
        )
    )
    assert _segments_of(out) == _expected(tok, segments)
    counting.texts.clear()
    out = splitter.split(
        {"prompt_segments": ["system", "doc one", "another"]}, PARAMS, counting
    )
    assert counting.texts == ["another"]
    assert _segments_of(out) == _expected(tok, ["system", "doc one", "another"])


def test_special_tokens_are_part_of_the_key():
    tok = build_toy_tokenizer()
    counting, splitter = _Counting(tok), _splitter()
    splitter.split({"prompt": "system ## doc ## q"}, PARAMS, counting)
    counting.texts.clear()
    # A chat template renders BOS itself and asks for no special tokens.
    no_special = _Params(
        add_special_tokens=False, truncate_prompt_tokens=None, split_chunks=True
    )
    out = splitter.split({"prompt": "system ## doc ## q"}, no_special, counting)
    assert counting.texts == ["system", "q"]
    assert _segments_of(out)[0] == tok.encode("system", add_special_tokens=False)


def test_tenants_and_tokenizers_never_share_an_entry():
    tok = build_toy_tokenizer()
    counting, splitter = _Counting(tok), _splitter()
    splitter.split(
        {"prompt": "system ## doc ## q", "cache_salt": "tenant-a"}, PARAMS, counting
    )
    counting.texts.clear()
    splitter.split(
        {"prompt": "system ## doc ## q", "cache_salt": "tenant-b"}, PARAMS, counting
    )
    assert counting.texts == ["system", "doc", "q"]
    other = _Counting(build_toy_tokenizer())
    splitter.split(
        {"prompt": "system ## doc ## q", "cache_salt": "tenant-b"}, PARAMS, other
    )
    assert other.texts == ["system", "doc", "q"]


def test_least_recently_used_segments_go_first_within_the_bound():
    cache, tok = SegmentTokenCache(max_tokens=10), object()
    a, b, c = (SegmentText(t, False, None) for t in "abc")
    cache.remember(tok, a, [1, 2, 3, 4])
    cache.remember(tok, b, [5, 6, 7, 8])
    assert cache.lookup(tok, a) == [1, 2, 3, 4]  # a is now the most recent
    cache.remember(tok, c, [9, 10, 11])
    assert cache.lookup(tok, b) is None
    assert cache.lookup(tok, a) == [1, 2, 3, 4] and cache.lookup(tok, c) == [9, 10, 11]
    assert (len(cache), cache.num_tokens) == (2, 7)
    cache.remember(
        tok, SegmentText("big", False, None), list(range(11))
    )  # over the bound
    assert (len(cache), cache.num_tokens) == (2, 7)


def test_threads_sharing_the_cache_keep_its_count_and_bound():
    import threading

    cache, tok = SegmentTokenCache(max_tokens=64), object()

    def work(worker):
        for i in range(2000):
            text = SegmentText(f"doc {(worker * 7 + i) % 40}", False, None)
            ids = cache.lookup(tok, text)
            if ids is None:
                cache.remember(tok, text, [i % 50] * (1 + i % 5))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.num_tokens == sum(len(e.token_ids) for e in cache._entries.values())
    assert cache.num_tokens <= 64
