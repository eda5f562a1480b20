# SPDX-License-Identifier: Apache-2.0
"""ChunkStore: the seam between the chunk cache and a fleet-wide byte store.

The store holds finished chunk entries (header + payload bytes, entry_format.py)
under typed keys (keys.py). It is shared by every replica, so nothing read from
it is trusted: the connector verifies each entry before it reaches the pool.

NOTE: every method may block on the network. The connector calls them from its
own thread (never from the scheduler's step or the forward), and a call that
has not answered yet is "not yet" to the engine, never a wait.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum


@dataclass(frozen=True)
class HostBuffer:
    """A span of host memory the store reads into or writes from (zero-copy
    where the backend registered it with `register_buffer`)."""

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
    """The negative per-key results of batch_get_into / batch_put_from: every
    backend maps its own codes to these, so the connector can count misses by
    cause without knowing the backend."""

    ABSENT = -1
    """No such key (never written, evicted, or forgotten by a restarted store)."""
    TOO_LARGE = -2
    """The value does not fit the buffer given for it."""
    TIMEOUT = -3
    """The call did not answer within the store's deadline (or an earlier call
    that did not answer is still running: the store refuses new calls until it
    returns)."""
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
        """Make `buffer` usable by the get/put calls below (once, at start-up)."""

    def unregister_buffer(self, buffer: HostBuffer) -> None:
        """Forget a buffer given to `register_buffer` (its memory is being
        reused). Only where `scatters` (the pool's registrations)."""
        raise NotImplementedError(f"{type(self).__name__} cannot unregister a buffer")

    def idle(self) -> bool:
        """No call is running, not even one given up on (then no store call
        can still write anywhere)."""
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
        """Read each key's value into its buffer; per key the number of bytes
        read (>= 0) or a negative StoreCode (absent, too large, timeout, error).
        Bytes read are not yet trusted: verify them (entry_format.py).

        NOTE: `on_release` runs once when the store no longer writes into
        `buffers`: before this returns, or, after a TIMEOUT, later (from the
        store's thread) when the abandoned call returned. Until then the
        buffers are the store's: reusing them lets a late read overwrite
        whatever was put there."""

    def batch_get_into_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[HostBuffer]],
        on_release: Release = no_release,
    ) -> list[int]:
        """batch_get_into with each key's value scattered over its buffers in
        order (the first buffer takes the value's first bytes); their sizes
        add up to the value's, else the key fails. Only where `scatters`."""
        on_release()
        raise NotImplementedError(f"{type(self).__name__} cannot scatter a value")

    @abstractmethod
    def batch_put_from(
        self,
        keys: Sequence[str],
        buffers: Sequence[HostBuffer],
        on_release: Release = no_release,
    ) -> list[int]:
        """Store each buffer's bytes under its key; per key 0 or a negative
        StoreCode. A key already present keeps its value (entries are
        immutable: the same key always names the same content). `on_release`
        as for batch_get_into (the store reads the buffers until it runs)."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection; later calls fail with an error code."""
