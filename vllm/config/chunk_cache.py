# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Configuration of the position-independent chunk KV cache."""

from typing import Literal

from vllm.config.utils import config

ChunkContext = Literal["sink", "none", "system"]
ChunkHashAlgo = Literal["xxhash"]


@config
class ChunkCacheConfig:
    """Position-independent chunk KV cache for RAG prompts written as
    `system <sep> doc <sep> doc ... <sep> question`. Every segment before the
    question is cached by its content and its KV is reused at any position."""

    enable_chunk_cache: bool = False
    """Cache every segment of a separator-marked prompt by its content and
    reuse its KV at any position (re-rotated with RoPE). Prompts without the
    separator are served exactly as without this flag."""

    chunk_separator: str = "##"
    """Text that separates the segments of a prompt; it is removed before
    tokenization. NOTE: "##" also starts Markdown headings, so documents that
    contain it are split too: choose a separator that cannot occur in them."""

    max_chunks: int = 500
    """Most segments (system prompt and chunks, not the question) one prompt
    may have; more is rejected with an error."""

    max_chunk_tokens: int = 4096
    """Most tokens one segment may have; a longer one is rejected with an
    error."""

    chunk_pool_fraction: float = 0.15
    """Share of the KV cache memory given to the chunk pool, the separate store
    of cached chunks (used unless --chunk-pool-size-gib is set)."""

    chunk_pool_size_gib: float | None = None
    """Size of the chunk pool in GiB; overrides --chunk-pool-fraction."""

    max_chunk_load_tokens: int = 16384
    """Most prompt tokens loaded from the chunk pool in one engine step, over
    all requests: a request whose load would pass it waits for the next step,
    unless it is the step's first (a longer load then runs alone, in pieces of
    this size). Loads cost ~14 ms per 16k rows (H100, Llama-3-8B shapes), and
    running requests' decodes wait for them. The workers' load buffers hold
    this many rows, inside the pool's memory."""

    chunk_hash_algo: ChunkHashAlgo = "xxhash"
    """Content hash of a chunk's key (xxh3-128). Hits are always verified
    against the stored token ids, so a collision never serves wrong KV."""

    chunk_context: ChunkContext = "sink"
    """What a cached chunk was computed after. "sink": one sink token (see
    --chunk-sink-token-id) right before the chunk, an attention sink private
    to it (default). "none": the chunk alone from position 0 (most reuse,
    lowest quality). "system": the whole system segment before the chunk (the
    key includes it: less reuse, closest to full attention)."""

    chunk_sink_token_id: int | None = None
    """Token id of the private sink of "sink" mode, a constant of the
    deployment so that a chunk's key never depends on the system prompt.
    Default: the tokenizer's BOS token; a model without one must set this."""

    chunk_recompute_tokens: int = 0
    """Boundary recompute: the first N tokens of every cached chunk are
    computed inside the request, attending to everything before them; the
    rest keeps its cached KV. 0 (default) recomputes nothing. Buys back answer
    quality lost to chunk isolation for N computed tokens per chunk
    (docs/quality.md, docs/design/boundary-recompute.md)."""

    chunk_store: str | None = None
    """A Mooncake Store shared by every replica, as a URL
    (mooncake://HOST:PORT?segment=0&buffer=16MB&timeout=5) or JSON
    ({"master": "HOST:PORT", ...}): entries missing from the pool are read
    from it, computed ones written to it. None (default): each instance keeps
    its own pool. Mooncake's TCP transport has no authentication: keep the
    store on a private network (docs/design/chunk-store.md)."""

    def __post_init__(self) -> None:
        sep = self.chunk_separator
        if not sep or not sep.strip():
            raise ValueError(
                "--chunk-separator must contain a non-whitespace character, "
                f"got {sep!r}"
            )
        if sep.strip() != sep:
            # NOTE: the prompt parser strips whitespace next to a separator;
            # refused here so a bad value fails at start-up, not per request.
            raise ValueError(
                f"--chunk-separator must not start or end with whitespace, got {sep!r}"
            )
        for flag, value, low in (
            ("--max-chunks", self.max_chunks, 1),
            ("--max-chunk-tokens", self.max_chunk_tokens, 1),
            ("--max-chunk-load-tokens", self.max_chunk_load_tokens, 1),
            ("--chunk-recompute-tokens", self.chunk_recompute_tokens, 0),
            ("--chunk-sink-token-id", self.chunk_sink_token_id, 0),
        ):
            if value is not None and value < low:
                raise ValueError(f"{flag} must be >= {low}, got {value}")
        fraction, size = self.chunk_pool_fraction, self.chunk_pool_size_gib
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"--chunk-pool-fraction must be in (0, 1), got {fraction}")
        if size is not None and size <= 0:
            raise ValueError(f"--chunk-pool-size-gib must be > 0, got {size}")
        if self.chunk_store is not None:
            self._check_chunk_store(self.chunk_store)

    def _check_chunk_store(self, chunk_store: str) -> None:
        # NOTE: imported here: vllm.config must not import vllm.distributed
        # while it loads (spec.py itself is stdlib only).
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store import (
            spec,
        )

        if not self.enable_chunk_cache:
            raise ValueError("--chunk-store needs --enable-chunk-cache")
        try:
            spec.parse_store_spec(chunk_store)
        except ValueError as e:
            raise ValueError(f"--chunk-store {chunk_store!r}: {e}") from None

    def resolve_sink_token_id(self, bos_token_id: int | None) -> None:
        """Fix the sink token at start-up: the flag, else the tokenizer's BOS."""
        if self.chunk_context != "sink" or self.chunk_sink_token_id is not None:
            return
        if bos_token_id is None:
            raise ValueError(
                "--chunk-context sink needs a sink token: the tokenizer has no BOS "
                "token, so set --chunk-sink-token-id (e.g. to an end-of-text or "
                "padding token id) or use --chunk-context none/system"
            )
        self.chunk_sink_token_id = int(bos_token_id)

    def describe(self) -> str:
        pool = (
            f"{self.chunk_pool_size_gib} GiB"
            if self.chunk_pool_size_gib is not None
            else f"{self.chunk_pool_fraction:.0%} of KV cache memory"
        )
        return (
            f"separator={self.chunk_separator!r}, max_chunks={self.max_chunks}, "
            f"max_chunk_tokens={self.max_chunk_tokens}, pool={pool}, "
            f"hash={self.chunk_hash_algo}, chunk_context={self.chunk_context}, "
            f"recompute_tokens={self.chunk_recompute_tokens}, "
            f"max_load_tokens={self.max_chunk_load_tokens}"
            + (f", store={self.chunk_store}" if self.chunk_store is not None else "")
            + (
                f", sink_token_id={self.chunk_sink_token_id}"
                if self.chunk_context == "sink"
                else ""
            )
        )
