# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ReadCost: whether reading an entry from the store is expected to be faster
than computing it here.

Over TCP a read can cost more than a prefill (an 8k-token document of an 8B
model is ~1 GiB of KV). The expected read time (the entry's bytes over the
slowest rank's measured read bandwidth) is weighed against the expected compute
time (its tokens over the prefill rate measured on this replica's children).
Until both are measured reads are taken; a skipped read is still taken once in
EXPLORE_EVERY, so a store that got faster is seen again.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of a new measurement in the running estimates.
_ALPHA = 0.3
EXPLORE_EVERY = 16


@dataclass
class ReadDecision:
    read: bool
    expected_read_s: float | None
    expected_compute_s: float | None


class ReadCost:
    def __init__(self) -> None:
        self.read_bytes_per_s: float | None = None
        self.compute_tokens_per_s: float | None = None
        self.row_bytes: int = 0
        self._skipped = 0

    def note_read_bandwidth(self, bytes_per_s: float) -> None:
        if bytes_per_s > 0:
            self.read_bytes_per_s = bytes_per_s

    def note_row_bytes(self, row_bytes: int) -> None:
        self.row_bytes = max(self.row_bytes, row_bytes)

    def note_compute(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        old = self.compute_tokens_per_s
        self.compute_tokens_per_s = (
            rate if old is None else (1 - _ALPHA) * old + _ALPHA * rate
        )

    def decide(self, num_rows: int, num_tokens: int) -> ReadDecision:
        """`num_rows` stored rows of an entry whose compute runs `num_tokens`
        tokens (its context included)."""
        if not (self.read_bytes_per_s and self.compute_tokens_per_s and self.row_bytes):
            return ReadDecision(True, None, None)
        read_s = num_rows * self.row_bytes / self.read_bytes_per_s
        compute_s = num_tokens / self.compute_tokens_per_s
        if read_s <= compute_s:
            return ReadDecision(True, read_s, compute_s)
        self._skipped += 1
        return ReadDecision(self._skipped % EXPLORE_EVERY == 0, read_s, compute_s)
