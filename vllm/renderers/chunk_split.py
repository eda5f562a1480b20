# SPDX-License-Identifier: Apache-2.0
"""Renderer glue of the chunk cache: split a prompt, mark it for the engine.

`BaseRenderer` holds one `ChunkPromptSplitter` when --enable-chunk-cache is
on (None otherwise, so nothing here runs per request with the feature off)
and calls it from `_tokenize_singleton_prompt(_async)`, the one place
offline generate/chat and the OpenAI server's completions/chat all pass
through:

* a text prompt containing the separator is split and every segment is
  tokenized on its own (the async path through vLLM's async tokenizer), or
  its ids are taken from the segment token cache (segment_token_cache.py:
  documents repeat, the question is never kept);
  special tokens go to the first segment only, and only if the request asked
  for them (chat templates render BOS themselves and ask for none);
* a token-id prompt is split where the separator's own token ids occur;
* a prompt without the separator is returned untouched (stock vLLM), and so
  is one whose request opted out (`split_chunks=False`);
* a prompt given as segments (`{"prompt_segments": [system, doc, ...,
  question]}`, strings or token-id lists; the completions API's
  `prompt_segments`) is tokenized per segment as given: no separator is
  searched and no whitespace stripped, so a document may contain anything.

The segment layout travels as the prompt's `chunk_layout` (segment token
counts), copied into `EngineCoreRequest.chunk_layout`: a field only this
module sets. A prompt that arrives with one is refused, and the request's
`cache_salt` is left as the client sent it (it keys the tenant's chunk
namespace and nothing else).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.exceptions import VLLMValidationError

from vllm.renderers.chunk_prompt_parser import ChunkedPromptParser
from vllm.renderers.segment_token_cache import SegmentText, SegmentTokenCache
from vllm.v1.core.chunk_structures import ChunkedPrompt

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Key of a rendered prompt that carries its segment layout.
LAYOUT_KEY = "chunk_layout"
# Key of a prompt given as its segments (system, documents..., question).
SEGMENTS_KEY = "prompt_segments"


class ChunkPromptError(VLLMValidationError):
    """A chunked prompt the chunk cache cannot serve.

    A VLLMValidationError, so the OpenAI server answers HTTP 400 through
    vLLM's own handler (no traceback in the log), as for its own checks.
    """


def make_splitter(vllm_config: VllmConfig) -> ChunkPromptSplitter | None:
    """The renderer's splitter; None when the chunk cache is off.

    NOTE: a config built without the chunk cache's field (a renderer made
    from a stand-in config, as vLLM's own renderer tests do) is "off" too:
    the renderer reads no chunk-cache state it was not given.
    """
    cfg = getattr(vllm_config, "chunk_cache_config", None)
    if cfg is None or not cfg.enable_chunk_cache:
        return None
    return ChunkPromptSplitter(vllm_config)


class ChunkPromptSplitter:
    """Per-renderer state: the parser and the separator's token ids."""

    def __init__(self, vllm_config: VllmConfig):
        cfg = vllm_config.chunk_cache_config
        self.parser = ChunkedPromptParser(
            cfg.chunk_separator, cfg.max_chunks, cfg.max_chunk_tokens
        )
        self._separator_ids: list[int] | None = None
        # Ids of recently seen segments (documents repeat across requests).
        self.token_cache = SegmentTokenCache()

    # ------------------------------------------------------------ hooks

    def split(self, prompt: dict, params: Any, tokenizer: Any) -> dict:
        """The prompt, tokenized per segment and marked if it is chunked."""
        if SEGMENTS_KEY not in prompt and not self._wants_split(prompt, params):
            return prompt
        segments = self._segments(prompt, params, tokenizer)
        if segments is None:
            return self._split_token_ids(prompt, tokenizer)
        token_lists = []
        for seg in self._plan(segments, prompt, params):
            ids = self._known_ids(seg, tokenizer)
            if ids is None:
                ids = self._tokenized(
                    seg,
                    tokenizer,
                    tokenizer.encode(
                        seg.text.text, add_special_tokens=seg.text.add_special_tokens
                    ),
                )
            token_lists.append(ids)
        return self._mark(prompt, self._parse(lambda: self.parser.build(token_lists)))

    async def split_async(
        self,
        prompt: dict,
        params: Any,
        tokenizer: Any,
        encode_async: Callable[..., Awaitable[list[int]]],
    ) -> dict:
        """`split`, with segments tokenized off the event loop by `encode_async`
        (`await encode_async(text, add_special_tokens=...)`: vLLM 0.23's async
        micro-batching tokenizer's `encode`, or 0.32's tokenizer `encode` run on the
        renderer's executor)."""
        if SEGMENTS_KEY not in prompt and not self._wants_split(prompt, params):
            return prompt
        segments = self._segments(prompt, params, tokenizer)
        if segments is None:
            return self._split_token_ids(prompt, tokenizer)

        async def encode(seg: _Segment) -> list[int]:
            ids = self._known_ids(seg, tokenizer)
            if ids is None:
                ids = self._tokenized(
                    seg,
                    tokenizer,
                    await encode_async(
                        seg.text.text, add_special_tokens=seg.text.add_special_tokens
                    ),
                )
            return ids

        token_lists = await asyncio.gather(
            *(encode(seg) for seg in self._plan(segments, prompt, params))
        )
        return self._mark(
            prompt, self._parse(lambda: self.parser.build(list(token_lists)))
        )

    def check_layout(self, prompt: dict) -> None:
        """The engine-facing prompt must still match its layout."""
        layout = prompt.get(LAYOUT_KEY)
        if layout is not None and sum(layout) != len(prompt["prompt_token_ids"]):
            raise ChunkPromptError(
                "the chunked prompt was changed after splitting (truncation or "
                "padding): its segment layout no longer matches its tokens"
            )

    # ---------------------------------------------------------- helpers

    def _segments(self, prompt: dict, params: Any, tokenizer: Any) -> list | None:
        """The prompt's segments (texts, or token-id lists when given so), or
        None when it is no text to split (no separator, or token ids)."""
        if SEGMENTS_KEY in prompt:
            return self._given_segments(prompt, params, tokenizer)
        text = self._text_to_split(prompt, params, tokenizer)
        if text is None:
            return None
        segments = self._parse(lambda: self.parser.split_text(text))
        assert segments is not None
        return segments

    def _known_ids(self, seg: _Segment, tokenizer: Any) -> list[int] | None:
        """The segment's ids without tokenizing: given, or remembered."""
        if seg.ids is not None:
            return seg.ids
        return self.token_cache.lookup(tokenizer, seg.text) if seg.keep else None

    def _tokenized(self, seg: _Segment, tokenizer: Any, ids: Any) -> list[int]:
        ids = list(ids)
        if seg.keep:
            self.token_cache.remember(tokenizer, seg.text, ids)
        return ids

    @staticmethod
    def _plan(segments: list, prompt: dict, params: Any) -> list[_Segment]:
        """Each segment as it is tokenized: special tokens on the first one
        only, and only if the request asked for them (chat templates render
        BOS themselves and ask for none); kept in the token cache unless it
        is the question."""
        special = bool(params.add_special_tokens)
        salt = prompt.get("cache_salt")
        last = len(segments) - 1
        return [
            _Segment(ids=seg, text=None, keep=False)
            if isinstance(seg, list)
            else _Segment(
                ids=None, text=SegmentText(seg, special and i == 0, salt), keep=i < last
            )
            for i, seg in enumerate(segments)
        ]

    def _given_segments(self, prompt: dict, params: Any, tokenizer: Any) -> list:
        """The segments of a prompt given as such, checked (a 400 naming the
        field and the limit for anything the engine cannot serve)."""
        segments = prompt[SEGMENTS_KEY]
        if LAYOUT_KEY in prompt:
            self._wants_split(prompt, params)  # refuses it
        others = [
            k for k in ("prompt", "prompt_token_ids", "prompt_embeds") if k in prompt
        ]
        if others:
            raise ChunkPromptError(
                f"'{SEGMENTS_KEY}' gives the whole prompt; it cannot be combined "
                f"with {', '.join(repr(k) for k in others)}",
                parameter=SEGMENTS_KEY,
            )
        if not getattr(params, "split_chunks", True):
            raise ChunkPromptError(
                f"'{SEGMENTS_KEY}' marks the segments explicitly; split_chunks=false "
                "cannot apply to it (send the text as 'prompt' to serve it unsplit)",
                parameter="split_chunks",
            )
        _refuse_truncation(params)
        if not isinstance(segments, list) or len(segments) < 2:
            raise ChunkPromptError(
                f"'{SEGMENTS_KEY}' must be a list of at least 2 segments (the system "
                "prompt first, the question last, documents between)",
                parameter=SEGMENTS_KEY,
            )
        texts = all(isinstance(seg, str) for seg in segments)
        ids = all(isinstance(seg, list) and _token_ids(seg) for seg in segments)
        if not (texts or ids):
            raise ChunkPromptError(
                f"'{SEGMENTS_KEY}' must be a list of strings or a list of token-id "
                "lists (non-negative integers), not a mix",
                parameter=SEGMENTS_KEY,
            )
        if texts and tokenizer is None:
            raise ChunkPromptError(
                f"text '{SEGMENTS_KEY}' need a tokenizer (the server was started "
                "with --skip-tokenizer-init): send token-id lists",
                parameter=SEGMENTS_KEY,
            )
        self._parse(lambda: self.parser.check_num_chunks(len(segments) - 2))
        return segments

    @staticmethod
    def _wants_split(prompt: dict, params: Any) -> bool:
        """False when the request opted out (split_chunks=False)."""
        if LAYOUT_KEY in prompt:
            raise ChunkPromptError(
                f"'{LAYOUT_KEY}' is set by the chunk cache from the separators in "
                "the prompt; a request may not carry one",
                parameter=LAYOUT_KEY,
            )
        return getattr(params, "split_chunks", True)

    def _text_to_split(self, prompt: dict, params: Any, tokenizer: Any) -> str | None:
        """The text of a separator-marked text prompt, else None."""
        if (
            tokenizer is None
            or "prompt_token_ids" in prompt
            or "prompt_embeds" in prompt
        ):
            return None
        text = prompt.get("prompt")
        if not isinstance(text, str) or self.parser.separator not in text:
            return None
        _refuse_truncation(params)
        pre = params.apply_pre_tokenization(tokenizer, {"prompt": text})
        return pre["prompt"]

    def _split_token_ids(self, prompt: dict, tokenizer: Any) -> dict:
        ids = prompt.get("prompt_token_ids")
        if tokenizer is None or ids is None or "prompt_embeds" in prompt:
            return prompt
        if self._separator_ids is None:
            self._separator_ids = self.parser.separator_token_ids(tokenizer)
        chunked = self._parse(
            lambda: self.parser.parse_token_ids(ids, self._separator_ids)
        )
        if chunked is None:
            return prompt
        prompt = dict(prompt)
        # NOTE: the text no longer matches the ids; let it be re-derived.
        prompt.pop("prompt", None)
        return self._mark(prompt, chunked)

    @staticmethod
    def _parse(parse):
        try:
            return parse()
        except ValueError as e:
            raise ChunkPromptError(str(e)) from e

    @staticmethod
    def _mark(prompt: dict, chunked: ChunkedPrompt) -> dict:
        prompt = dict(prompt)
        prompt.pop(SEGMENTS_KEY, None)
        prompt["prompt_token_ids"] = chunked.token_ids
        prompt[LAYOUT_KEY] = list(chunked.segment_lengths)
        return prompt


def _refuse_truncation(params: Any) -> None:
    if getattr(params, "truncate_prompt_tokens", None) is not None:
        raise ChunkPromptError(
            "truncate_prompt_tokens cannot be used with a chunked prompt "
            "(truncation would cut segments of the chunk layout)",
            parameter="truncate_prompt_tokens",
        )


def _token_ids(seg: list) -> bool:
    """Whether every item is a non-negative int (bool excluded).

    NOTE: map(type, ...) and min() walk the list in C: a 500-token document
    costs no Python bytecode per token.
    """
    return not seg or (set(map(type, seg)) == {int} and min(seg) >= 0)


@dataclass(frozen=True)
class _Segment:
    """One segment to tokenize: its ids when given as such, else its text."""

    ids: list[int] | None
    text: SegmentText | None
    keep: bool


def validate_chunked_request(
    vllm_config: VllmConfig, params: Any, token_ids: list[int], layout: list[int]
) -> None:
    """Refuse, in the front end, what the chunk cache cannot serve exactly.

    Called by the InputProcessor for requests with a chunk layout.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        POOL_BLOCK_SIZE,
        pool_num_blocks_from_config,
    )
    from vllm.v1.core.chunk_cache_manager import oversized_message, pool_blocks_for

    if getattr(params, "prompt_logprobs", None) is not None:
        raise ChunkPromptError(
            "prompt_logprobs is not supported for chunked prompts: the cached "
            "segments are not recomputed, so their logprobs do not exist",
            parameter="prompt_logprobs",
        )
    pool_blocks = pool_num_blocks_from_config(vllm_config)
    if pool_blocks is None:
        return  # the engine has not reported its KV cache yet: it checks itself
    prompt = ChunkedPrompt.from_lengths(token_ids, layout)
    mode = vllm_config.chunk_cache_config.chunk_context
    needed = pool_blocks_for(prompt, POOL_BLOCK_SIZE, mode)
    if needed > pool_blocks:
        raise ChunkPromptError(oversized_message(needed, pool_blocks, POOL_BLOCK_SIZE))
