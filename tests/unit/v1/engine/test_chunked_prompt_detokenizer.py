# SPDX-License-Identifier: Apache-2.0
"""Patch 0018: a chunked prompt's decode stream is primed with its last 32 tokens.

The oracle is vLLM's own fully primed stream: the same FastIncrementalDetokenizer given
the same request without a chunk layout (every prompt token primes it, as for any other
request). On two tokenizers of different kinds (tiny-llama's SentencePiece-style pieces,
SmolLM2's byte-level BPE), over prompts cut anywhere in real text and continuations of
real text and of random ids (byte tokens that leave a character unfinished included),
with and without skip_special_tokens, every step's text must be the same.
"""

import random

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.detokenizer import (
    CHUNKED_PROMPT_PRIME_TOKENS,
    FastIncrementalDetokenizer,
)

from tests.conftest import REPO, models_dir


def _request(
    prompt: list[int], chunk_layout, skip_special_tokens: bool
) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=32, skip_special_tokens=skip_special_tokens)
    return EngineCoreRequest(
        request_id="r",
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        chunk_layout=chunk_layout,
    )


def _texts(tokenizer, prompt, generated, chunk_layout, skip) -> list[str]:
    detok = FastIncrementalDetokenizer(tokenizer, _request(prompt, chunk_layout, skip))
    return [detok.decode_next(t) for t in generated]


@pytest.mark.parametrize("model", ["tiny-llama", "SmolLM2-135M-Instruct"])
def test_a_chunked_prompt_decodes_the_same_text_as_when_fully_primed(model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(models_dir() / model))
    text = (REPO / "README.md").read_text() + (
        REPO / "docs" / "user-guide.md"
    ).read_text()
    ids = tokenizer(text)["input_ids"]
    rng = random.Random(model)
    vocab = len(tokenizer)
    for case in range(120):
        start = rng.randrange(len(ids) - 700)
        prompt = ids[start : start + rng.randint(CHUNKED_PROMPT_PRIME_TOKENS + 1, 600)]
        if case % 3 == 0:
            generated = [rng.randrange(vocab) for _ in range(16)]
        else:
            at = rng.randrange(len(ids) - 16)
            generated = ids[at : at + 16]
        layout = [len(prompt) // 2, len(prompt) - len(prompt) // 2]
        for skip in (True, False):
            assert _texts(tokenizer, prompt, generated, layout, skip) == _texts(
                tokenizer, prompt, generated, None, skip
            ), (case, skip)


def test_only_the_tail_primes_a_chunked_prompt(monkeypatch):
    """What each stream is primed with (tokenizers' DecodeStream, looked up on its
    module as vLLM does): a chunked prompt's last 32 tokens; another request's whole
    prompt."""
    import tokenizers.decoders
    from transformers import AutoTokenizer

    primed = []
    real = tokenizers.decoders.DecodeStream
    monkeypatch.setattr(
        tokenizers.decoders,
        "DecodeStream",
        lambda ids=None, **kw: primed.append(list(ids)) or real(ids=ids, **kw),
    )
    tokenizer = AutoTokenizer.from_pretrained(str(models_dir() / "tiny-llama"))
    prompt = tokenizer("word " * 300)["input_ids"]
    FastIncrementalDetokenizer(
        tokenizer, _request(prompt, [150, len(prompt) - 150], True)
    )
    FastIncrementalDetokenizer(tokenizer, _request(prompt, None, True))
    assert primed == [prompt[-CHUNKED_PROMPT_PRIME_TOKENS:], prompt]
