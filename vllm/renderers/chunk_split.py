# SPDX-License-Identifier: Apache-2.0
"""Renderer glue of the chunk cache: split a prompt, mark it for the engine.

Called from `BaseRenderer._tokenize_singleton_prompt(_async)` (the one place
offline generate/chat and the OpenAI server's completions/chat all pass
through):

* a text prompt containing the separator is split and every segment is
  tokenized on its own (`ChunkedPromptParser.parse_text`); special tokens
  go to the first segment only, and only if the request asked for them
  (chat templates render BOS themselves and ask for none);
* a token-id prompt is split where the separator's own token ids occur;
* a prompt without the separator is returned untouched (stock vLLM).

The segment layout travels to the scheduler inside the request's
`cache_salt` (see `encode_layout_salt`). That one field reaches the engine
core on every path without further plumbing, and it is exactly the salt the
design wants: vLLM's own prefix cache hashes it into every block, so paged
blocks holding chunk-isolated KV are shared only between requests with the
same layout (whose KV is identical), never with normal requests. The user's
own salt is kept inside it, so tenants stay isolated too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.renderers.chunk_prompt_parser import ChunkedPromptParser
from vllm.v1.core.chunk_structures import ChunkedPrompt, SegmentSpan

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Salts in this namespace are reserved: a user salt may not start with it.
RESERVED_SALT_PREFIX = "vllm-chunk-cache/"
# Prefix of layout salts.
LAYOUT_SALT_PREFIX = RESERVED_SALT_PREFIX + "v1/"
_NO_USER_SALT = "-"
_USER_SALT = "="


class ChunkPromptError(ValueError):
    """A chunked prompt the chunk cache cannot serve (HTTP 400 online)."""


def encode_layout_salt(lengths: list[int], user_salt: str | None) -> str:
    """The cache salt of a chunked request: segment lengths + user salt."""
    user = _NO_USER_SALT if user_salt is None else _USER_SALT + user_salt
    return f"{LAYOUT_SALT_PREFIX}{','.join(map(str, lengths))}/{user}"


def decode_layout_salt(salt: str | None) -> tuple[list[int], str | None] | None:
    """(segment lengths, user salt) of a layout salt; None for other salts."""
    if not salt or not salt.startswith(LAYOUT_SALT_PREFIX):
        return None
    try:
        lengths_text, user = salt[len(LAYOUT_SALT_PREFIX):].split("/", 1)
        lengths = [int(x) for x in lengths_text.split(",")]
    except ValueError:
        return None
    if user == _NO_USER_SALT:
        return lengths, None
    if not user.startswith(_USER_SALT):
        return None
    return lengths, user[len(_USER_SALT):]


def chunked_prompt_from_salt(
    token_ids: list[int], salt: str | None
) -> tuple[ChunkedPrompt, str | None] | None:
    """Rebuild the ChunkedPrompt of a request from its ids and salt."""
    decoded = decode_layout_salt(salt)
    if decoded is None:
        return None
    lengths, user_salt = decoded
    spans, start = [], 0
    for length in lengths:
        spans.append(SegmentSpan(start, start + length))
        start += length
    try:
        prompt = ChunkedPrompt(token_ids=list(token_ids), spans=tuple(spans))
    except ValueError:
        # NOTE: the renderer only writes consistent layouts; anything else
        # (e.g. a request that bypassed it) is served as a normal request.
        return None
    return prompt, user_salt


class _SegmentEncoder:
    """Tokenizer adapter: special tokens on the first segment only, and only
    if the request asked for them."""

    def __init__(self, tokenizer: Any, add_special_tokens: bool):
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(
            self.tokenizer.encode(
                text, add_special_tokens=add_special_tokens and self.add_special_tokens
            )
        )


class ChunkPromptSplitter:
    """Per-renderer state: the parser and the separator's token ids."""

    def __init__(self, vllm_config: VllmConfig):
        cfg = vllm_config.chunk_cache_config
        self.enabled = bool(cfg.enable_chunk_cache)
        self.parser = ChunkedPromptParser(
            cfg.chunk_separator, cfg.max_chunks, cfg.max_chunk_tokens
        )
        self._separator_ids: list[int] | None = None

    # ------------------------------------------------------------ hooks

    def split_text(self, prompt: dict, params: Any, tokenizer: Any) -> dict | None:
        """TokensPrompt for a separator-marked text prompt, else None."""
        if not self.enabled or tokenizer is None:
            return None
        self._check_user_salt(prompt)
        text = prompt.get("prompt")
        if not isinstance(text, str) or self.parser.separator not in text:
            return None
        if getattr(params, "truncate_prompt_tokens", None) is not None:
            raise ChunkPromptError(
                "truncate_prompt_tokens cannot be used with a chunked prompt "
                "(truncation would cut segments of the chunk layout)"
            )
        encoder = _SegmentEncoder(tokenizer, bool(params.add_special_tokens))
        try:
            chunked = self.parser.parse_text(text, encoder)
        except ValueError as e:
            raise ChunkPromptError(str(e)) from e
        assert chunked is not None
        return self._mark(dict(prompt), chunked)

    def split_token_ids(self, prompt: dict, tokenizer: Any) -> dict:
        """Split a token-id prompt on the separator's ids (or return it)."""
        if not self.enabled or tokenizer is None:
            return prompt
        self._check_user_salt(prompt)
        ids = prompt.get("prompt_token_ids")
        if ids is None or "prompt_embeds" in prompt:
            return prompt
        if self._separator_ids is None:
            self._separator_ids = self.parser.separator_token_ids(tokenizer)
        try:
            chunked = self.parser.parse_token_ids(ids, self._separator_ids)
        except ValueError as e:
            raise ChunkPromptError(str(e)) from e
        if chunked is None:
            return prompt
        prompt = dict(prompt)
        # NOTE: the text no longer matches the ids; let it be re-derived.
        prompt.pop("prompt", None)
        return self._mark(prompt, chunked)

    def check_after_validation(self, prompt: dict) -> dict:
        """The engine-facing prompt must still match its layout."""
        decoded = decode_layout_salt(prompt.get("cache_salt"))
        if decoded is not None and "prompt_token_ids" in prompt:
            if sum(decoded[0]) != len(prompt["prompt_token_ids"]):
                raise ChunkPromptError(
                    "the chunked prompt was changed after splitting "
                    "(truncation or padding): its segment layout no longer "
                    "matches its tokens"
                )
        return prompt

    # ---------------------------------------------------------- helpers

    def _check_user_salt(self, prompt: dict) -> None:
        salt = prompt.get("cache_salt")
        if isinstance(salt, str) and salt.startswith(RESERVED_SALT_PREFIX):
            raise ChunkPromptError(
                f"cache_salt may not start with {RESERVED_SALT_PREFIX!r} "
                "(reserved by the chunk cache)"
            )

    @staticmethod
    def _mark(prompt: dict, chunked: ChunkedPrompt) -> dict:
        lengths = [span.num_tokens for span in chunked.spans]
        prompt["prompt_token_ids"] = chunked.token_ids
        prompt["cache_salt"] = encode_layout_salt(lengths, prompt.get("cache_salt"))
        return prompt


def get_splitter(renderer: Any) -> ChunkPromptSplitter:
    """The renderer's splitter, created on first use."""
    splitter = getattr(renderer, "_chunk_prompt_splitter", None)
    if splitter is None:
        splitter = ChunkPromptSplitter(renderer.config)
        renderer._chunk_prompt_splitter = splitter
    return splitter


def validate_chunked_request(params: Any, cache_salt: str | None) -> None:
    """Refuse request options the chunk cache cannot honour exactly.

    Called by the InputProcessor with the request's sampling params.
    """
    if decode_layout_salt(cache_salt) is None:
        return
    if getattr(params, "prompt_logprobs", None) is not None:
        raise ChunkPromptError(
            "prompt_logprobs is not supported for chunked prompts: the cached "
            "segments are not recomputed, so their logprobs do not exist"
        )
