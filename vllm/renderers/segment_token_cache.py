# SPDX-License-Identifier: Apache-2.0
"""Token ids of the segments the front end tokenized recently, by their text.

A RAG deployment sends the same documents again and again; the chunk cache
reuses their KV, but the renderer still tokenized every document of every
request: for an all-hit request that is most of the host work left
(docs/benchmarks.md, "Host work of an all-hit request": 16 documents of 500
tokens, ~8k tokens, tokenized on every request). A segment is tokenized on
its own (chunk_split.py), so its ids depend on its text, the tokenizer and
whether special tokens were asked for, and on nothing else: a hit returns
the ids a fresh encode would.

NOTE: an entry is a tenant's, like a chunk-cache entry: the key holds the
request's `cache_salt`, so a tenant never gets another's entry (nor learns
from a faster answer that another sent the same text). The question (the
last segment) is new with every request and is not kept: it would only
push documents out.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# NOTE: ~4 bytes per id plus the text (a few bytes per token): about 10 MB of
# front-end memory at this bound, the ids of 2,000 documents of 500 tokens.
DEFAULT_MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class SegmentText:
    """What a segment's ids depend on, besides the tokenizer."""

    text: str
    add_special_tokens: bool
    cache_salt: str | None


@dataclass(frozen=True)
class _Entry:
    # NOTE: held so that the tokenizer's id() in the key cannot be reused by
    # another tokenizer while the entry exists.
    tokenizer: Any
    token_ids: array


class SegmentTokenCache:
    """Least recently used segments' ids, at most `max_tokens` ids in all.

    NOTE: one per renderer, whose sync path may run on other threads than
    the event loop's: a lock keeps the order and the count consistent."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS):
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._entries: OrderedDict[tuple[int, SegmentText], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokenizer: Any, segment: SegmentText) -> list[int] | None:
        key = (id(tokenizer), segment)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.tokenizer is not tokenizer:
                return None
            self._entries.move_to_end(key)
        return entry.token_ids.tolist()

    def remember(
        self, tokenizer: Any, segment: SegmentText, token_ids: list[int]
    ) -> None:
        if len(token_ids) > self.max_tokens:
            return
        key = (id(tokenizer), segment)
        entry = _Entry(tokenizer, array("I", token_ids))
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_tokens -= len(old.token_ids)
            self._entries[key] = entry
            self.num_tokens += len(token_ids)
            while self.num_tokens > self.max_tokens:
                _, evicted = self._entries.popitem(last=False)
                self.num_tokens -= len(evicted.token_ids)
