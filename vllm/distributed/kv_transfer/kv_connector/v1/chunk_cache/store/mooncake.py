# SPDX-License-Identifier: Apache-2.0
"""MooncakeChunkStore: the ChunkStore over Mooncake Store (the only backend on
the data path).

Every call is bounded. Measured with mooncake-transfer-engine-non-cuda
0.3.13.post1 over loopback TCP (docs/design/chunk-store.md): with the master
stopped (SIGSTOP, as a network partition looks) each call blocked 30 s; with
the node's mooncake_client stopped a get blocked 60 s; setup against a dead
master returned after 90 s. So:

1. Mooncake's own timeouts are set from the spec's `timeout_s` (environment
   variables it reads at setup; a value the user exported wins), which made
   those calls return an error in ~timeout_s;
2. each call runs on one of this store's lanes (deadline.py: existence
   queries, reads, writes) and the caller waits at most `timeout_s`: a call
   still running then is a StoreCode.TIMEOUT, and its lane refuses new calls
   (TIMEOUT, at once) until it returns, so calls never pile up behind a stuck
   one.

NOTE: a get or put that timed out may still write into (or read from) its
buffers when it finally returns: the buffers stay the call's until its
`on_release` runs (base.py), which the lane does only when Mooncake returned.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

from .base import ChunkStore, HostBuffer, Presence, Release, StoreCode, no_release
from .deadline import CallResult, CallStatus, DeadlineLane
from .spec import StoreSpec

logger = init_logger(__name__)

# Mooncake Store's own result codes (mooncake-store/include/types.h) that map to
# something other than StoreCode.ERROR.
_MC_BUFFER_OVERFLOW = -600
_MC_OBJECT_NOT_FOUND = -704
# Codes of a get answered before any transfer was submitted (bad arguments, the
# master's RPC failed): nothing of it is left in flight.
_MC_BEFORE_TRANSFER = (-10, _MC_BUFFER_OVERFLOW, _MC_OBJECT_NOT_FOUND, -900, -901)
# NOTE (issue 50, finding 1's last edge): a get Mooncake returned as failed (or
# that raised) is never released: its memory stays its own for the process's
# life. Measured with 0.3.13.post1, in-process client over TCP, the segment
# holder stopped: the batch gave up after its 60 s transfer wait
# (TRANSFER_FAIL) and returned, but the TCP transport kept retrying its slices
# on new connections (each dropped after 30 s without progress: at +30, +61,
# +92, +123 s, for as long as the holder stayed stopped), and the one open when
# the holder resumed wrote the value into the buffers: after `on_release` had
# run, into a closed engine's freed pool, a heap corruption in the next engine.
# No finite wait bounds that, and Mooncake offers no cancel. A get that
# transferred every key, or failed before any transfer (_MC_BEFORE_TRANSFER),
# has nothing left in flight. Through the node's client the same: the
# transfers are that process's, whose transport retries just the same, into
# the dummy client's shared memory; released when the call returned, the span
# went to the next read, and a late write could change its bytes between
# verification (get thread) and the copy into the pool (step thread). So a
# failed get is retired in both modes. What a retired get held: arena spans
# (never freed: the arena shrinks by them, and a read finding no room is a
# miss), and with `direct_reads` pool tensors (kept here) and pool rows (lent
# until the scheduler writes them off at held_limit).
_RETIRED: list[Release] = []
_RETIRED_LOCK = threading.Lock()
# NOTE: setup connects, mounts and registers: give it more than one call's deadline.
_SETUP_DEADLINE_FACTOR = 4
_MIN_SETUP_DEADLINE_S = 10.0


def mooncake_timeout_env(timeout_s: float) -> dict[str, str]:
    """Mooncake's timeouts for one call bounded by `timeout_s` (measured: these
    bound a call to a stopped master (RPC) and to a stopped segment holder
    (TCP transfer); without them they take 30 s and 60 s)."""
    seconds = str(max(1, math.floor(timeout_s)))
    millis = str(max(100, int(timeout_s * 1000)))
    return {
        "MC_RPC_TIMEOUT_MS": millis,
        "MC_RPC_CONNECT_TIMEOUT_MS": millis,
        "MC_TCP_PROGRESS_TIMEOUT_SEC": seconds,
        "MC_TCP_STATUS_TIMEOUT_SEC": seconds,
        "MC_HANDSHAKE_CONNECT_TIMEOUT": seconds,
        # One try at setup: a wrong or dead master fails in seconds, not minutes.
        "MC_STORE_CLIENT_SETUP_RETRIES": "1",
    }


@dataclass
class StoreCallStats:
    """What this connection's calls came to (the connector exports metrics)."""

    calls: int = 0
    timeouts: int = 0
    # Failed gets whose memory is never released (Mooncake may still write into it).
    gets_retired: int = 0
    refused_while_stuck: int = 0
    errors: int = 0


# NOTE: Mooncake reads its timeouts from the environment at setup only: they are
# set for the setup call and put back after it (under this lock, as two
# connections may set up at once), so no other Mooncake user of the process
# (e.g. vLLM's PD connector) sees values it did not ask for.
_ENV_LOCK = threading.Lock()


def _setup_with_env(env: dict[str, str], setup: Callable[[], Any]) -> Any:
    with _ENV_LOCK:
        before = {name: os.environ.get(name) for name in env}
        for name, value in env.items():
            if before[name] is None:  # the user's own setting wins
                os.environ[name] = value
        try:
            return setup()
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)


class MooncakeChunkStore(ChunkStore):
    """A connection to a Mooncake Store (one per process and TP rank)."""

    def __init__(self, spec: StoreSpec, client: Any):
        self.spec = spec
        self.stats = StoreCallStats()
        self._client = client
        # NOTE: one lane per kind of call (deadline.py): reads never wait
        # behind writes, nor existence queries behind either.
        name = f"chunk-store-{spec.master_address}"
        self._lanes = {
            kind: DeadlineLane(f"{name}-{kind}") for kind in ("query", "get", "put")
        }
        self._closed = False
        self._stuck_since: float | None = None
        self._stats_lock = threading.Lock()

    @classmethod
    def connect(cls, spec: StoreSpec, shared_pool_bytes: int = 0) -> MooncakeChunkStore:
        """Set up a Mooncake client against `spec`'s master; RuntimeError naming
        the master when that fails or does not answer in time. Blocks up to
        the setup deadline: never call it where a request waits (connection.py
        connects on a thread of its own).

        With `spec.local_client`, Mooncake's dummy client instead, against
        the node's standalone client, with `shared_pool_bytes` of shared
        memory: the only memory its transfers can use (`alloc_host`)."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RuntimeError(
                f"--chunk-store needs Mooncake Store's Python client ({e}): pip install "
                "mooncake-transfer-engine-non-cuda==0.3.13.post1 (and, on Debian/Ubuntu, "
                "apt-get install -y --no-install-recommends libibverbs1 libnuma1); "
                "`./fork setup` installs both"
            ) from e
        client = MooncakeDistributedStore()
        lane = DeadlineLane(f"chunk-store-{spec.master_address}-setup")
        deadline = max(_MIN_SETUP_DEADLINE_S, _SETUP_DEADLINE_FACTOR * spec.timeout_s)
        t0 = time.monotonic()
        env = mooncake_timeout_env(spec.timeout_s)
        if spec.local_client is not None:
            # NOTE: the pool must hold every buffer a transfer is given (they are
            # carved from it), and at least the local buffer.
            pool = max(shared_pool_bytes, spec.buffer_bytes) + (1 << 20)
            setup = lambda: client.setup_dummy(
                pool,
                spec.buffer_bytes,  # noqa: E731
                spec.local_client,
            )
        else:
            setup = lambda: client.setup(  # noqa: E731
                spec.local_hostname,
                spec.metadata_server,
                spec.segment_bytes,
                spec.buffer_bytes,
                spec.protocol,
                "",
                spec.master_address,
            )
        result = lane.call(lambda: _setup_with_env(env, setup), deadline)
        lane.stop()
        if result.status is not CallStatus.OK or result.value != 0:
            why = {
                CallStatus.TIMEOUT: f"no answer within {deadline:.0f} s",
                CallStatus.RAISED: f"raised {result.value!r}",
            }.get(result.status, f"setup returned {result.value}")
            if result.status is not CallStatus.TIMEOUT:
                # NOTE: a client whose setup failed is closed here, so a store that
                # stays down does not leak one client per try; one still inside
                # setup cannot be closed safely and is left to finish.
                try:
                    client.close()
                except Exception:  # noqa: BLE001 - best effort on a failed client
                    pass
            if spec.local_client is not None:
                raise RuntimeError(
                    f"--chunk-store: cannot reach the node's mooncake_client at "
                    f"{spec.local_client} ({why}); is it running there (its --port)?"
                )
            raise RuntimeError(
                f"--chunk-store: cannot connect to the Mooncake master at "
                f"{spec.master_address} over {spec.protocol} ({why}); is "
                f"mooncake_master running there, and a mooncake_client lending memory?"
            )
        if spec.local_client is not None:
            logger.info(
                "chunk store: connected to the node's mooncake_client at %s in "
                "%.2f s (dummy client: transfers are made by that process; %d "
                "bytes of shared memory)",
                spec.local_client,
                time.monotonic() - t0,
                shared_pool_bytes,
            )
        else:
            logger.info(
                "chunk store: connected to the Mooncake master at %s over %s in %.2f s "
                "(call deadline %.1f s, this process lends %d bytes)",
                spec.master_address,
                spec.protocol,
                time.monotonic() - t0,
                spec.timeout_s,
                spec.segment_bytes,
            )
        return cls(spec, client)

    def alloc_host(self, nbytes: int) -> int:
        """With a local client: the address of `nbytes` of the shared memory its
        transfers use (registered); RuntimeError when the pool is too small."""
        assert self.spec.local_client is not None
        result = self._call("query", lambda: self._client.alloc_from_mem_pool(nbytes))
        if result.status is not CallStatus.OK or not result.value:
            raise RuntimeError(
                f"chunk store: no {nbytes} bytes left in the shared memory "
                f"of the node's mooncake_client ({result.status.value})"
            )
        return int(result.value)

    # -- the seam ---------------------------------------------------------------

    def register_buffer(self, buffer: HostBuffer) -> None:
        result = self._call(
            "query", lambda: self._client.register_buffer(buffer.ptr, buffer.nbytes)
        )
        if result.status is not CallStatus.OK or result.value != 0:
            raise RuntimeError(
                f"chunk store: registering a {buffer.nbytes}-byte host buffer with the "
                f"Mooncake client failed ({result.status.value}, {result.value})"
            )

    def unregister_buffer(self, buffer: HostBuffer) -> None:
        result = self._call("query", lambda: self._client.unregister_buffer(buffer.ptr))
        if result.status is not CallStatus.OK or result.value != 0:
            raise RuntimeError(
                f"chunk store: unregistering a {buffer.nbytes}-byte host buffer from the "
                f"Mooncake client failed ({result.status.value}, {result.value})"
            )

    def batch_exists(self, keys: Sequence[str]) -> list[Presence]:
        if not keys:
            return []
        result = self._call("query", lambda: self._client.batch_is_exist(list(keys)))
        if result.status is not CallStatus.OK or len(result.value) != len(keys):
            return [Presence.ERROR] * len(keys)
        out = []
        for code in result.value:
            if code == 1:
                out.append(Presence.PRESENT)
            elif code == 0:
                out.append(Presence.ABSENT)
            else:
                out.append(Presence.ERROR)
        self._count("errors", sum(p is Presence.ERROR for p in out))
        return out

    def batch_get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[HostBuffer],
        on_release: Release = no_release,
    ) -> list[int]:
        return self._transfer(
            "get", self._client.batch_get_into, keys, buffers, on_release
        )

    # Mooncake's batch_get_into_multi_buffers (measured with 0.3.13.post1: the
    # sizes must add up to the value's exactly, else -600 or -800).
    scatters = True

    def batch_get_into_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[HostBuffer]],
        on_release: Release = no_release,
    ) -> list[int]:
        ptrs = [[b.ptr for b in buffers] for buffers in parts]
        sizes = [[b.nbytes for b in buffers] for buffers in parts]
        return self._codes(
            "get",
            lambda: self._client.batch_get_into_multi_buffers(list(keys), ptrs, sizes),
            keys,
            len(parts),
            on_release,
        )

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffers: Sequence[HostBuffer],
        on_release: Release = no_release,
    ) -> list[int]:
        return self._transfer(
            "put", self._client.batch_put_from, keys, buffers, on_release
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if any(lane.busy() for lane in self._lanes.values()):
            # NOTE: closing the client under a call that is still running could
            # crash the process; leak the connection instead (the process is
            # usually exiting).
            logger.warning(
                "chunk store: closing while a call to %s is still running; "
                "the connection is left open",
                self.spec.master_address,
            )
            return
        self._lanes["query"].call(self._client.close, self.spec.timeout_s)
        for lane in self._lanes.values():
            lane.stop()

    # -- beyond the seam -----------------------------------------------------

    def remove(self, key: str) -> int:
        """Remove one key (tests, tools); 0 or a negative StoreCode."""
        result = self._call("query", lambda: self._client.remove(key))
        if result.status is not CallStatus.OK:
            return self._failure_code(result.status)
        if result.value == 0:
            return 0
        return (
            StoreCode.ABSENT
            if result.value == _MC_OBJECT_NOT_FOUND
            else StoreCode.ERROR
        )

    def idle(self) -> bool:
        """No call is running (a timed-out one may still be)."""
        return not any(lane.busy() for lane in self._lanes.values())

    def wait_idle(self, timeout_s: float) -> bool:
        t_end = time.monotonic() + timeout_s
        return all(
            lane.wait_idle(max(0.0, t_end - time.monotonic()))
            for lane in self._lanes.values()
        )

    # -- internals ------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        # NOTE: the lanes' callers are three threads.
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def _call(
        self, kind: str, fn: Callable[[], Any], on_release: Release = no_release
    ) -> CallResult:
        if self._closed:
            on_release()
            return CallResult(CallStatus.CLOSED)
        self._count("calls")
        result = self._lanes[kind].call(fn, self.spec.timeout_s, on_release)
        if result.status is CallStatus.TIMEOUT:
            self._count("timeouts")
            if self._stuck_since is None:
                self._stuck_since = time.monotonic()
                logger.warning(
                    "chunk store: a %s call to the Mooncake store at %s did not answer "
                    "within %.1f s; such calls are misses until it returns",
                    kind,
                    self.spec.master_address,
                    self.spec.timeout_s,
                )
        elif result.status is CallStatus.BUSY:
            self._count("refused_while_stuck")
        elif result.status is CallStatus.RAISED:
            self._count("errors")
            logger.warning("chunk store: a Mooncake call raised %r", result.value)
        elif self._stuck_since is not None and self.idle():
            logger.info(
                "chunk store: the Mooncake store at %s answers again (a call was "
                "stuck for %.1f s)",
                self.spec.master_address,
                time.monotonic() - self._stuck_since,
            )
            self._stuck_since = None
        return result

    def _transfer(
        self,
        kind: str,
        method,
        keys: Sequence[str],
        buffers: Sequence[HostBuffer],
        on_release: Release,
    ) -> list[int]:
        return self._codes(
            kind,
            lambda: method(
                list(keys), [b.ptr for b in buffers], [b.nbytes for b in buffers]
            ),
            keys,
            len(buffers),
            on_release,
        )

    def _codes(
        self,
        kind: str,
        fn: Callable[[], Any],
        keys: Sequence[str],
        num_destinations: int,
        on_release: Release,
    ) -> list[int]:
        """One transfer call on `kind`'s lane: per key bytes read / 0, or a
        StoreCode. `num_destinations`: the buffers (or lists of them) given."""
        if len(keys) != num_destinations:
            on_release()
            raise ValueError(f"{len(keys)} keys but {num_destinations} destinations")
        if not keys:
            on_release()
            return []
        n = len(keys)
        if kind == "get":
            fn, on_release = self._deferred_if_failed(fn, n, on_release)
        result = self._call(kind, fn, on_release)
        if result.status is not CallStatus.OK:
            return [self._failure_code(result.status)] * n
        return self._map_codes(result.value, n, get=kind == "get")

    def _deferred_if_failed(
        self, fn: Callable[[], Any], n: int, on_release: Release
    ) -> tuple[Callable[[], Any], Release]:
        """`fn` and `on_release` for a get: its memory is released when the call
        returned only if Mooncake transferred every key (or found it absent);
        after a failure (or an exception) never (see _RETIRED: its transport
        may still write into it). A call never started (refused, closed) is
        released at once."""
        state = {"suspect": False}

        def run() -> Any:
            state["suspect"] = True  # inside Mooncake: suspect until it says done
            value = fn()
            state["suspect"] = not self._transferred_all(value, n)
            return value

        def release() -> None:
            if not state["suspect"]:
                on_release()
                return
            self._count("gets_retired")
            with _RETIRED_LOCK:
                _RETIRED.append(on_release)  # holds what the call was given
            logger.warning(
                "chunk store: a get failed inside Mooncake; the memory it was "
                "given is never reused in this process (its transport may "
                "still write into it; %d such gets)",
                len(_RETIRED),
            )

        return run, release

    @staticmethod
    def _transferred_all(value: Any, n: int) -> bool:
        """Mooncake's answer says no transfer of the call is left: each key's
        bytes landed, or it failed before a transfer was submitted for it."""
        return (
            isinstance(value, list)
            and len(value) == n
            and all(code >= 0 or code in _MC_BEFORE_TRANSFER for code in value)
        )

    def _failure_code(self, status: CallStatus) -> int:
        if status in (CallStatus.TIMEOUT, CallStatus.BUSY):
            return StoreCode.TIMEOUT
        if status is CallStatus.CLOSED:
            return StoreCode.CLOSED
        return StoreCode.ERROR

    def _map_codes(self, result: Any, n: int, *, get: bool) -> list[int]:
        if not isinstance(result, list) or len(result) != n:
            self._count("errors", n)
            return [StoreCode.ERROR] * n
        out = []
        for code in result:
            if code >= 0:
                out.append(int(code) if get else 0)
            elif code == _MC_OBJECT_NOT_FOUND:
                out.append(StoreCode.ABSENT)
            elif code == _MC_BUFFER_OVERFLOW:
                out.append(StoreCode.TOO_LARGE)
            else:
                self._count("errors")
                out.append(StoreCode.ERROR)
        return out
