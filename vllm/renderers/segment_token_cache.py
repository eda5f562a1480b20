# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Token ids of the segments the front end tokenized recently, by their text.

RAG requests repeat their documents: their KV comes from the chunk cache, and
their ids from here instead of a new encode on every request
(docs/benchmarks.md, "Host work of an all-hit request"). A segment is
tokenized on its own, so its ids depend only on its text, the tokenizer and
whether special tokens were asked for. The key holds the request's
`cache_salt`: a tenant never gets (or times) another's entry. The question
changes with every request and is not kept.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# ~4 bytes per id plus the text: about 10 MB, 2,000 documents of 500 tokens.
DEFAULT_MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class SegmentText:
    """What a segment's ids depend on, besides the tokenizer."""

    text: str
    add_special_tokens: bool
    cache_salt: str | None


@dataclass(frozen=True)
class _Entry:
    # Held so that the tokenizer's id() in the key is not reused meanwhile.
    tokenizer: Any
    token_ids: array


class SegmentTokenCache:
    """Least recently used segments' ids, at most `max_tokens` ids in all
    (locked: a renderer's sync path may run on threads other than the loop's)."""

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
