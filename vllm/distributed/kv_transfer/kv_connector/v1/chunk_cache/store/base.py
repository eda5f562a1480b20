# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ChunkStore: the seam between the chunk cache and a fleet-wide byte store.

The store holds finished chunk entries (entry_format.py) under typed keys
(keys.py). Every replica writes to it, so nothing read from it is trusted: each
entry is verified before it reaches the pool. Every method may block on the
network, so the connector calls them from threads of its own, never the step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum


@dataclass(frozen=True)
class HostBuffer:
    """Host memory the store reads into or writes from."""

    ptr: int
    nbytes: int


# Called once when the store no longer touches a call's buffers.
Release = Callable[[], None]


def no_release() -> None:
    return None


class Presence(Enum):
    PRESENT = "present"
    ABSENT = "absent"
    ERROR = "error"


class StoreCode(IntEnum):
    """The negative per-key results of the batch calls, whatever the backend."""

    ABSENT = -1
    """No such key (never written, evicted, or forgotten by a restarted store)."""
    TOO_LARGE = -2
    """The value does not fit the buffer given for it."""
    TIMEOUT = -3
    """No answer within the deadline (or an earlier call still runs)."""
    ERROR = -4
    """Any other failure: master unreachable, transfer failed, store full."""
    CLOSED = -5
    """The store was closed."""


class ChunkStore(ABC):
    """Batch exists / get into a buffer / put from a buffer, by string key."""

    # Whether `batch_get_into_parts` can scatter a value over several buffers
    # (a read straight into the pool's rows, which are never one buffer).
    scatters: bool = False

    @abstractmethod
    def register_buffer(self, buffer: HostBuffer) -> None:
        """Make `buffer` usable by the get/put calls below."""

    def unregister_buffer(self, buffer: HostBuffer) -> None:
        """Forget a registered buffer (only where `scatters`: the pool's)."""
        raise NotImplementedError(f"{type(self).__name__} cannot unregister a buffer")

    def alloc_host(self, nbytes: int) -> int:
        """The address of `nbytes` of the memory the store's transfers use, for
        a client whose transfers another process makes; RuntimeError if none."""
        raise RuntimeError(
            f"{type(self).__name__} has no shared memory to lend (--chunk-store "
            "local_client=none runs the client in this process)"
        )

    def idle(self) -> bool:
        """No call is running, not even one given up on."""
        return True

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[Presence]:
        """One answer per key, in order."""

    @abstractmethod
    def batch_get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[HostBuffer],
        on_release: Release = no_release,
    ) -> list[int]:
        """Read each key's value into its buffer; per key the bytes read or a
        negative StoreCode. The bytes are not trusted yet (entry_format.py).

        `on_release` runs once the store no longer writes into `buffers`:
        before this returns or, after a TIMEOUT, when the abandoned call does.
        Until then the buffers are the store's."""

    def batch_get_into_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[HostBuffer]],
        on_release: Release = no_release,
    ) -> list[int]:
        """batch_get_into with each value scattered over its buffers in order
        (their sizes add up to the value's, else it fails). Where `scatters`."""
        on_release()
        raise NotImplementedError(f"{type(self).__name__} cannot scatter a value")

    @abstractmethod
    def batch_put_from(
        self,
        keys: Sequence[str],
        buffers: Sequence[HostBuffer],
        on_release: Release = no_release,
    ) -> list[int]:
        """Store each buffer under its key; per key 0 or a negative StoreCode. A
        key present keeps its value. `on_release` as for batch_get_into."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection; later calls fail with an error code."""
