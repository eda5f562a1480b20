# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""HostArena: the worker's host memory for store reads and writes.

One block of host memory registered with the store once, carved first-fit into
spans for the entries in flight. A span that does not fit now is refused (the
caller counts a miss), never waited for.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

ALIGN = 64


class HostArena:
    def __init__(self, nbytes: int, ptr: int | None = None):
        """`nbytes` of new memory, or the `nbytes` at `ptr` (the dummy client's
        shared memory)."""
        self.nbytes = nbytes
        if ptr is None:
            # Pinned with a GPU: copies to and from the pool are asynchronous.
            self.tensor = torch.empty(
                nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available()
            )
        else:
            self._memory = (ctypes.c_uint8 * nbytes).from_address(ptr)
            self.tensor = torch.frombuffer(self._memory, dtype=torch.uint8)
        self.ptr = self.tensor.data_ptr()
        # The store threads read through numpy (bytes_view), never torch views.
        self._array = self.tensor.numpy()
        # Free spans (offset, size), sorted by offset.
        self._free: list[tuple[int, int]] = [(0, nbytes)]
        # Span start -> (its free-list offset, bytes it took).
        self._spans: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def allocate(self, nbytes: int, tail_align_at: int = 0) -> int | None:
        """Offset of a span of `nbytes` whose byte `tail_align_at` is
        ALIGN-aligned (an entry's payload after its header), or None."""
        need = nbytes + ALIGN
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size < need:
                    continue
                start = off + (-(off + tail_align_at)) % ALIGN
                used = start - off + nbytes
                rest = size - used
                if rest:
                    self._free[i] = (off + used, rest)
                else:
                    del self._free[i]
                # The alignment gap before `start` stays with the span.
                self._spans[start] = (off, used)
                return start
        return None

    def free(self, start: int) -> None:
        with self._lock:
            off, used = self._spans.pop(start)
            self._free.append((off, used))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for o, s in self._free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((o, s))
            self._free = merged

    def view(self, start: int, nbytes: int) -> torch.Tensor:
        return self.tensor[start : start + nbytes]

    def bytes_view(self, start: int, nbytes: int) -> np.ndarray:
        return self._array[start : start + nbytes]

    def in_use(self) -> int:
        with self._lock:
            return self.nbytes - sum(s for _, s in self._free)
