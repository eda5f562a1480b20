# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Renderer glue of the chunk cache: split a prompt, mark it for the engine.

With --enable-chunk-cache, `BaseRenderer._tokenize_singleton_prompt(_async)`
(offline generate/chat, the OpenAI server's completions/chat) calls
`ChunkPromptSplitter`: a text prompt containing --chunk-separator is split and
each segment tokenized on its own (special tokens on the first only, if asked
for); a token-id prompt is split where the separator's ids occur; a prompt
given as `prompt_segments` is tokenized per segment as given. Anything else,
or a request with `split_chunks=False`, is left to stock vLLM. The segment
token counts travel as the prompt's `chunk_layout`, which only this sets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from vllm.exceptions import VLLMValidationError
from vllm.renderers.chunk_prompt_parser import ChunkedPromptParser
from vllm.renderers.segment_token_cache import SegmentText, SegmentTokenCache
from vllm.v1.core.chunk_structures import ChunkContextMode, ChunkedPrompt

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Key of a rendered prompt that carries its segment layout.
LAYOUT_KEY = "chunk_layout"
# Key of a prompt given as its segments (system, documents..., question).
SEGMENTS_KEY = "prompt_segments"

_T = TypeVar("_T")


class ChunkPromptError(VLLMValidationError):
    """A chunked prompt the chunk cache cannot serve: a VLLMValidationError, so
    the OpenAI server answers it with a 400 through vLLM's own handler."""


def make_splitter(vllm_config: VllmConfig) -> ChunkPromptSplitter | None:
    """The renderer's splitter; None when the chunk cache is off, or the config
    has no chunk cache field (a stand-in config, as vLLM's renderer tests use)."""
    cfg = getattr(vllm_config, "chunk_cache_config", None)
    if cfg is None or not cfg.enable_chunk_cache:
        return None
    return ChunkPromptSplitter(vllm_config)


@dataclass(frozen=True)
class _Text:
    """A segment to tokenize; kept in the token cache unless the question."""

    text: SegmentText
    keep: bool


# A segment as given in token ids, or its text to tokenize.
_Segment: TypeAlias = list[int] | _Text


class ChunkPromptSplitter:
    """Per-renderer state: the parser, the separator's ids, the token cache."""

    def __init__(self, vllm_config: VllmConfig):
        cfg = vllm_config.chunk_cache_config
        self.parser = ChunkedPromptParser(
            cfg.chunk_separator, cfg.max_chunks, cfg.max_chunk_tokens
        )
        self._separator_ids: list[int] | None = None
        self.token_cache = SegmentTokenCache()

    def split(self, prompt: dict, params: Any, tokenizer: Any) -> dict:
        """The prompt, tokenized per segment and marked if it is chunked."""
        plan = self._plan(prompt, params, tokenizer)
        if plan is None:
            return self._split_token_ids(prompt, params, tokenizer)
        texts = [seg.text for seg in plan if isinstance(seg, _Text)]
        encoded = [
            tokenizer.encode(t.text, add_special_tokens=t.add_special_tokens)
            for t in texts
        ]
        return self._build(prompt, plan, tokenizer, encoded)

    async def split_async(
        self,
        prompt: dict,
        params: Any,
        tokenizer: Any,
        encode_async: Callable[..., Awaitable[list[int]]],
    ) -> dict:
        """`split`, with segments tokenized off the event loop by
        `await encode_async(text, add_special_tokens=...)`."""
        plan = self._plan(prompt, params, tokenizer)
        if plan is None:
            return self._split_token_ids(prompt, params, tokenizer)
        texts = [seg.text for seg in plan if isinstance(seg, _Text)]
        encoded = await asyncio.gather(
            *(
                encode_async(t.text, add_special_tokens=t.add_special_tokens)
                for t in texts
            )
        )
        return self._build(prompt, plan, tokenizer, encoded)

    def check_layout(self, prompt: dict) -> None:
        """The engine-facing prompt must still match its layout."""
        layout = prompt.get(LAYOUT_KEY)
        if layout is not None and sum(layout) != len(prompt["prompt_token_ids"]):
            raise ChunkPromptError(
                "the chunked prompt was changed after splitting (truncation or "
                "padding): its segment layout no longer matches its tokens"
            )

    def _build(
        self, prompt: dict, plan: list[_Segment], tokenizer: Any, encoded: list
    ) -> dict:
        """The marked prompt of `plan`, its texts' ids from `encoded` (in order),
        which the token cache keeps unless the question's."""
        fresh = iter(encoded)
        token_lists = []
        for seg in plan:
            if isinstance(seg, _Text):
                ids = list(next(fresh))
                if seg.keep:
                    self.token_cache.remember(tokenizer, seg.text, ids)
                seg = ids
            token_lists.append(seg)
        return self._mark(prompt, _parse(lambda: self.parser.build(token_lists)))

    def _plan(self, prompt: dict, params: Any, tokenizer: Any) -> list[_Segment] | None:
        """The segments: token ids (given, or remembered) or texts to tokenize;
        None when the prompt is no text to split (no separator, token ids, or
        the request opted out)."""
        if LAYOUT_KEY in prompt:
            raise ChunkPromptError(
                f"'{LAYOUT_KEY}' is set by the chunk cache from the separators in "
                "the prompt; a request may not carry one",
                parameter=LAYOUT_KEY,
            )
        if SEGMENTS_KEY in prompt:
            segments = self._given_segments(prompt, params, tokenizer)
        else:
            text = self._text_to_split(prompt, params, tokenizer)
            if text is None:
                return None
            split = _parse(lambda: self.parser.split_text(text))
            if split is None:
                return None
            segments = split
        special = bool(params.add_special_tokens)
        salt = prompt.get("cache_salt")
        last = len(segments) - 1
        plan: list[_Segment] = []
        for i, seg in enumerate(segments):
            if isinstance(seg, str):
                key = SegmentText(seg, special and i == 0, salt)
                known = self.token_cache.lookup(tokenizer, key) if i < last else None
                seg = _Text(key, keep=i < last) if known is None else known
            plan.append(seg)
        return plan

    def _given_segments(self, prompt: dict, params: Any, tokenizer: Any) -> list:
        """The segments of a prompt given as such, checked (a 400 naming the
        field and the limit for anything the engine cannot serve)."""
        segments = prompt[SEGMENTS_KEY]
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
        _parse(lambda: self.parser.check_num_chunks(len(segments) - 2))
        return segments

    def _text_to_split(self, prompt: dict, params: Any, tokenizer: Any) -> str | None:
        """The text of a separator-marked text prompt, else None."""
        if (
            tokenizer is None
            or not getattr(params, "split_chunks", True)
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

    def _split_token_ids(self, prompt: dict, params: Any, tokenizer: Any) -> dict:
        ids = prompt.get("prompt_token_ids")
        if (
            tokenizer is None
            or ids is None
            or "prompt_embeds" in prompt
            or not getattr(params, "split_chunks", True)
        ):
            return prompt
        if self._separator_ids is None:
            self._separator_ids = self.parser.separator_token_ids(tokenizer)
        separator_ids = self._separator_ids
        chunked = _parse(lambda: self.parser.parse_token_ids(ids, separator_ids))
        if chunked is None:
            return prompt
        prompt = dict(prompt)
        # The text no longer matches the ids; let it be re-derived.
        prompt.pop("prompt", None)
        return self._mark(prompt, chunked)

    @staticmethod
    def _mark(prompt: dict, chunked: ChunkedPrompt) -> dict:
        prompt = dict(prompt)
        prompt.pop(SEGMENTS_KEY, None)
        prompt["prompt_token_ids"] = chunked.token_ids
        prompt[LAYOUT_KEY] = list(chunked.segment_lengths)
        return prompt


def _parse(parse: Callable[[], _T]) -> _T:
    try:
        return parse()
    except ValueError as e:
        raise ChunkPromptError(str(e)) from e


def _refuse_truncation(params: Any) -> None:
    if getattr(params, "truncate_prompt_tokens", None) is not None:
        raise ChunkPromptError(
            "truncate_prompt_tokens cannot be used with a chunked prompt "
            "(truncation would cut segments of the chunk layout)",
            parameter="truncate_prompt_tokens",
        )


def _token_ids(seg: list) -> bool:
    """Whether every item is a non-negative int (bool excluded), walked in C
    by map(type, ...) and min(): no Python bytecode per token."""
    return not seg or (set(map(type, seg)) == {int} and min(seg) >= 0)


def validate_chunked_request(
    vllm_config: VllmConfig, params: Any, token_ids: list[int], layout: list[int]
) -> None:
    """Refuse, in the front end (the InputProcessor, for requests with a chunk
    layout), what the chunk cache cannot serve exactly."""
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
    mode = ChunkContextMode(vllm_config.chunk_cache_config.chunk_context)
    needed = pool_blocks_for(prompt, POOL_BLOCK_SIZE, mode)
    if needed > pool_blocks:
        raise ChunkPromptError(oversized_message(needed, pool_blocks, POOL_BLOCK_SIZE))
