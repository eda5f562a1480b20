# SPDX-License-Identifier: Apache-2.0
"""Configuration of the position-independent chunk KV cache (chunk-cache fork)."""

from typing import Literal

from vllm.config.utils import config
from vllm.logger import init_logger

logger = init_logger(__name__)

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
    all requests. A request whose load would pass it waits for the next step,
    unless nothing was loaded yet in this step (every request gets its turn;
    a longer load then runs alone, in pieces of this size). Loads are copies,
    not attention, but not free (~14 ms per 16k rows measured on an H100 with
    Llama-3-8B shapes) and every running request's decode waits for them. The
    workers' load buffers hold this many rows, inside the pool's memory."""

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
    Default: the tokenizer's BOS token, whether or not prompts start with it;
    a model without a BOS token must set this flag (start-up fails otherwise)."""

    chunk_recompute_tokens: int = 0
    """Boundary recompute: the first N tokens of every cached chunk are
    computed inside the request, attending to the system prompt and to every
    earlier chunk; the rest of the chunk keeps its cached KV. 0 (default)
    recomputes nothing. Buys back answer quality lost to chunk isolation at
    the cost of computing N tokens per chunk and one engine step per chunk
    (docs/quality.md, docs/design/boundary-recompute.md)."""

    chunk_store: str | None = None
    """The fleet tier: a Mooncake Store shared by every replica, as a URL
    (mooncake://HOST:PORT?segment=0&buffer=16MB&timeout=5) or JSON
    ({"master": "HOST:PORT", ...}). Entries missing from the pool are read
    from it before they are computed, and computed ones are written to it.
    None (default): no store, each instance keeps its own pool. Mooncake's TCP
    transport has no authentication: keep the store on a private network
    (docs/design/chunk-store.md)."""

    def __post_init__(self) -> None:
        if not self.chunk_separator or not self.chunk_separator.strip():
            raise ValueError(
                "chunk_separator must contain a non-whitespace character, "
                f"got {self.chunk_separator!r}"
            )
        if self.chunk_separator.strip() != self.chunk_separator:
            # NOTE: the same rule as ChunkedPromptParser, which strips whitespace next to
            # a separator; checked here so a bad value fails at start-up, not per request.
            raise ValueError(
                "chunk_separator must not start or end with whitespace, "
                f"got {self.chunk_separator!r}"
            )
        if self.max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {self.max_chunks}")
        if self.max_chunk_tokens < 1:
            raise ValueError(
                f"max_chunk_tokens must be >= 1, got {self.max_chunk_tokens}"
            )
        if self.max_chunk_load_tokens < 1:
            raise ValueError(
                f"max_chunk_load_tokens must be >= 1, got {self.max_chunk_load_tokens}"
            )
        if not 0.0 < self.chunk_pool_fraction < 1.0:
            raise ValueError(
                f"chunk_pool_fraction must be in (0, 1), got {self.chunk_pool_fraction}"
            )
        if self.chunk_recompute_tokens < 0:
            raise ValueError(
                "chunk_recompute_tokens must be >= 0, "
                f"got {self.chunk_recompute_tokens}"
            )
        if self.chunk_sink_token_id is not None and self.chunk_sink_token_id < 0:
            raise ValueError(
                f"chunk_sink_token_id must be >= 0, got {self.chunk_sink_token_id}"
            )
        if self.chunk_pool_size_gib is not None and self.chunk_pool_size_gib <= 0:
            raise ValueError(
                f"chunk_pool_size_gib must be > 0, got {self.chunk_pool_size_gib}"
            )
        if self.chunk_store is not None:
            self._check_chunk_store()

    def _check_chunk_store(self) -> None:
        # NOTE: imported here, not at module level: vllm.config must not import
        # vllm.distributed while it loads; spec.py itself is stdlib only.
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.spec import (
            parse_store_spec,
        )

        if not self.enable_chunk_cache:
            raise ValueError("--chunk-store needs --enable-chunk-cache")
        try:
            parse_store_spec(self.chunk_store)
        except ValueError as e:
            raise ValueError(f"--chunk-store {self.chunk_store!r}: {e}") from None

    def resolve_sink_token_id(self, bos_token_id: int | None) -> None:
        """Fix the sink token at start-up (flag, else the tokenizer's BOS)."""
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
