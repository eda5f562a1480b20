# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MooncakeChunkStore: the ChunkStore over Mooncake Store.

Every call is bounded (measured in docs/design/chunk-store.md, "Every call is
bounded"): Mooncake's own timeouts are set from the spec's `timeout_s` (a
value the user exported wins), and each call runs on a lane (deadline.py) whose
caller waits at most `timeout_s`. A call that timed out may still use its
buffers: they stay the call's until its `on_release` runs.
"""

from __future__ import annotations

import contextlib
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

# Mooncake Store's result codes (mooncake-store/include/types.h).
_MC_BUFFER_OVERFLOW = -600
_MC_OBJECT_NOT_FOUND = -704
# Codes of a get answered before any transfer was submitted: nothing in flight.
_MC_BEFORE_TRANSFER = (-10, _MC_BUFFER_OVERFLOW, _MC_OBJECT_NOT_FOUND, -900, -901)
# A get that failed in transfer is never released: Mooncake's transport keeps
# retrying its slices and may write into its memory at any later time, with no
# cancel (docs/design/chunk-store.md, "retired gets"). Its release is kept here.
_RETIRED: list[Release] = []
_RETIRED_LOCK = threading.Lock()
# Setup connects, mounts and registers: more than one call's deadline.
_SETUP_DEADLINE_FACTOR = 4
_MIN_SETUP_DEADLINE_S = 10.0


def mooncake_timeout_env(timeout_s: float) -> dict[str, str]:
    """Mooncake's timeouts that bound a call to a stopped master (RPC) and to a
    stopped segment holder (TCP) by `timeout_s` (else 30 s and 60 s)."""
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
    """What this connection's calls came to."""

    calls: int = 0
    timeouts: int = 0
    gets_retired: int = 0
    refused_while_stuck: int = 0
    errors: int = 0


# Mooncake reads its timeouts from the environment at setup only: set for the
# setup call alone, so no other Mooncake user of the process sees them.
_ENV_LOCK = threading.Lock()


def _setup_with_env(env: dict[str, str], setup: Callable[[], Any]) -> Any:
    with _ENV_LOCK:
        ours = [name for name in env if name not in os.environ]  # the user's win
        os.environ.update({name: env[name] for name in ours})
        try:
            return setup()
        finally:
            for name in ours:
                os.environ.pop(name, None)


class MooncakeChunkStore(ChunkStore):
    """A connection to a Mooncake Store (one per process and TP rank)."""

    def __init__(self, spec: StoreSpec, client: Any):
        self.spec = spec
        self.stats = StoreCallStats()
        self._client = client
        # Reads never wait behind writes, nor existence queries behind either.
        name = f"chunk-store-{spec.master_address}"
        self._lanes = {
            kind: DeadlineLane(f"{name}-{kind}") for kind in ("query", "get", "put")
        }
        self._closed = False
        self._stuck_since: float | None = None
        self._stats_lock = threading.Lock()

    @classmethod
    def connect(cls, spec: StoreSpec, shared_pool_bytes: int = 0) -> MooncakeChunkStore:
        """A Mooncake client set up against `spec`'s master (blocks up to the
        setup deadline); RuntimeError naming it when that fails. With
        `spec.local_client`, Mooncake's dummy client against the node's client,
        with `shared_pool_bytes` of shared memory (`alloc_host`)."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RuntimeError(
                f"--chunk-store needs Mooncake Store's Python client ({e}): pip "
                "install mooncake-transfer-engine-non-cuda==0.3.13.post1 (on "
                "Debian/Ubuntu also apt-get install libibverbs1 libnuma1)"
            ) from e
        client = MooncakeDistributedStore()
        lane = DeadlineLane(f"chunk-store-{spec.master_address}-setup")
        deadline = max(_MIN_SETUP_DEADLINE_S, _SETUP_DEADLINE_FACTOR * spec.timeout_s)
        t0 = time.monotonic()
        env = mooncake_timeout_env(spec.timeout_s)
        if spec.local_client is not None:
            # Every buffer a transfer is given is carved from this pool.
            pool = max(shared_pool_bytes, spec.buffer_bytes) + (1 << 20)
            setup = lambda: client.setup_dummy(
                pool, spec.buffer_bytes, spec.local_client
            )
        else:
            setup = lambda: client.setup(
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
                # Closed, so a store that stays down leaks no client per try
                # (one still inside setup cannot be closed safely).
                with contextlib.suppress(Exception):
                    client.close()
            if spec.local_client is not None:
                raise RuntimeError(
                    f"--chunk-store: cannot reach the node's mooncake_client at "
                    f"local_client={spec.local_client} ({why}); is it running "
                    "there (its --port)?"
                )
            raise RuntimeError(
                f"--chunk-store: cannot connect to the Mooncake master at "
                f"{spec.master_address} over {spec.protocol} ({why}); is "
                "mooncake_master running there, and a mooncake_client lending "
                "memory?"
            )
        where = (
            f"the node's mooncake_client at {spec.local_client} (a dummy client, "
            f"{shared_pool_bytes} bytes of shared memory)"
            if spec.local_client is not None
            else f"the Mooncake master at {spec.master_address} over "
            f"{spec.protocol} (this process lends {spec.segment_bytes} bytes)"
        )
        seconds = time.monotonic() - t0
        logger.info("chunk store: connected to %s in %.2f s", where, seconds)
        return cls(spec, client)

    def alloc_host(self, nbytes: int) -> int:
        assert self.spec.local_client is not None
        result = self._call("query", lambda: self._client.alloc_from_mem_pool(nbytes))
        if result.status is not CallStatus.OK or not result.value:
            raise RuntimeError(
                f"chunk store: no {nbytes} bytes left in the shared memory "
                f"of the node's mooncake_client ({result.status.value})"
            )
        return int(result.value)

    def register_buffer(self, buffer: HostBuffer) -> None:
        result = self._call(
            "query", lambda: self._client.register_buffer(buffer.ptr, buffer.nbytes)
        )
        if result.status is not CallStatus.OK or result.value != 0:
            raise RuntimeError(
                f"chunk store: registering a {buffer.nbytes}-byte host buffer "
                f"failed ({result.status.value}, {result.value})"
            )

    def unregister_buffer(self, buffer: HostBuffer) -> None:
        result = self._call("query", lambda: self._client.unregister_buffer(buffer.ptr))
        if result.status is not CallStatus.OK or result.value != 0:
            raise RuntimeError(
                f"chunk store: unregistering a {buffer.nbytes}-byte host buffer "
                f"failed ({result.status.value}, {result.value})"
            )

    def batch_exists(self, keys: Sequence[str]) -> list[Presence]:
        if not keys:
            return []
        result = self._call("query", lambda: self._client.batch_is_exist(list(keys)))
        if result.status is not CallStatus.OK or len(result.value) != len(keys):
            return [Presence.ERROR] * len(keys)
        answers = {1: Presence.PRESENT, 0: Presence.ABSENT}
        out = [answers.get(code, Presence.ERROR) for code in result.value]
        self._count("errors", sum(p is Presence.ERROR for p in out))
        return out

    def batch_get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[HostBuffer],
        on_release: Release = no_release,
    ) -> list[int]:
        ptrs, sizes = [b.ptr for b in buffers], [b.nbytes for b in buffers]
        call = lambda: self._client.batch_get_into(list(keys), ptrs, sizes)
        return self._codes("get", call, keys, len(buffers), on_release)

    # batch_get_into_multi_buffers: the sizes must add up to the value's.
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
        ptrs, sizes = [b.ptr for b in buffers], [b.nbytes for b in buffers]
        call = lambda: self._client.batch_put_from(list(keys), ptrs, sizes)
        return self._codes("put", call, keys, len(buffers), on_release)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.idle():
            # Closing the client under a running call could crash the process.
            logger.warning(
                "chunk store: closing while a call to %s is still running; "
                "the connection is left open",
                self.spec.master_address,
            )
            return
        self._lanes["query"].call(self._client.close, self.spec.timeout_s)
        for lane in self._lanes.values():
            lane.stop()

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
        return not any(lane.busy() for lane in self._lanes.values())

    def wait_idle(self, timeout_s: float) -> bool:
        t_end = time.monotonic() + timeout_s
        return all(
            lane.wait_idle(max(0.0, t_end - time.monotonic()))
            for lane in self._lanes.values()
        )

    def _count(self, name: str, n: int = 1) -> None:
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
                    "chunk store: a %s call to the Mooncake store at %s did not "
                    "answer within %.1f s; such calls are misses until it returns",
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
                "chunk store: the Mooncake store at %s answers again (a call "
                "was stuck for %.1f s)",
                self.spec.master_address,
                time.monotonic() - self._stuck_since,
            )
            self._stuck_since = None
        return result

    def _codes(
        self,
        kind: str,
        fn: Callable[[], Any],
        keys: Sequence[str],
        num_destinations: int,
        on_release: Release,
    ) -> list[int]:
        """One transfer on `kind`'s lane: per key bytes read / 0, or a StoreCode."""
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
        """`fn` and `on_release` for a get: released when the call returned
        only if nothing of it is left in flight, else retired (_RETIRED); a
        call never started (refused, closed) is released at once."""
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
        return (
            isinstance(value, list)
            and len(value) == n
            and all(code >= 0 or code in _MC_BEFORE_TRANSFER for code in value)
        )

    def _failure_code(self, status: CallStatus) -> int:
        return {
            CallStatus.TIMEOUT: StoreCode.TIMEOUT,
            CallStatus.BUSY: StoreCode.TIMEOUT,
            CallStatus.CLOSED: StoreCode.CLOSED,
        }.get(status, StoreCode.ERROR)

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
