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
2. each call runs on this store's own worker thread and the caller waits at
   most `timeout_s`: a call still running then is a StoreCode.TIMEOUT, and the
   store refuses new calls (TIMEOUT, at once) until it returns, so calls never
   pile up behind a stuck one.

NOTE: a get that timed out may still write into its buffers when it finally
returns. `idle()` says whether no call is running; a caller must not give the
memory of a timed-out get's buffers to anything else before `idle()` (or
`wait_idle`) is true. Whatever lands in a buffer is verified before use
(entry_format.py), so a late write can never be served, only wasted.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

from .base import ChunkStore, HostBuffer, Presence, StoreCode
from .spec import StoreSpec

logger = init_logger(__name__)

# Mooncake Store's own result codes (mooncake-store/include/types.h) that map to
# something other than StoreCode.ERROR.
_MC_BUFFER_OVERFLOW = -600
_MC_OBJECT_NOT_FOUND = -704
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
    refused_while_stuck: int = 0
    errors: int = 0


class _Job:
    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class _DeadlineWorker:
    """One daemon thread that runs the store's calls; the caller waits for each
    at most its deadline.

    NOTE: daemon, and not a ThreadPoolExecutor: the executor's threads are
    joined at interpreter exit, so one call stuck in Mooncake would hang the
    process's exit."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._running: _Job | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.result = job.fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                job.error = e
            job.done.set()

    def busy(self) -> bool:
        job = self._running
        return job is not None and not job.done.is_set()

    def call(self, fn: Callable[[], Any], deadline_s: float) -> tuple[str, Any]:
        """("ok", result) | ("timeout", None) | ("busy", None): a call that
        timed out before is still running) | ("raised", exception)."""
        # NOTE: the deadline covers the wait for another thread's call too: calls
        # from several threads run one at a time, and none waits longer than its own.
        t_end = time.monotonic() + deadline_s
        if not self._lock.acquire(timeout=deadline_s):
            return "busy", None
        try:
            if self.busy():
                return "busy", None
            job = _Job(fn)
            self._running = job
            self._jobs.put(job)
            if not job.done.wait(max(0.0, t_end - time.monotonic())):
                return "timeout", None
            self._running = None
        finally:
            self._lock.release()
        if job.error is not None:
            return "raised", job.error
        return "ok", job.result

    def wait_idle(self, timeout_s: float) -> bool:
        job = self._running
        return job is None or job.done.wait(timeout_s)

    def stop(self) -> None:
        self._jobs.put(None)


class MooncakeChunkStore(ChunkStore):
    """A connection to a Mooncake Store (one per process and TP rank)."""

    def __init__(self, spec: StoreSpec, client: Any, worker: _DeadlineWorker):
        self.spec = spec
        self.stats = StoreCallStats()
        self._client = client
        self._worker = worker
        self._closed = False
        self._stuck_since: float | None = None

    @classmethod
    def connect(cls, spec: StoreSpec) -> "MooncakeChunkStore":
        """Set up a Mooncake client against `spec`'s master; RuntimeError naming
        the master when that fails or does not answer in time."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RuntimeError(
                f"--chunk-store needs Mooncake Store's Python client ({e}): pip install "
                "mooncake-transfer-engine-non-cuda==0.3.13.post1 (and, on Debian/Ubuntu, "
                "apt-get install -y --no-install-recommends libibverbs1 libnuma1); "
                "`./fork setup` installs both"
            ) from e
        for name, value in mooncake_timeout_env(spec.timeout_s).items():
            # NOTE: the user's own setting wins; Mooncake reads these at setup, so the
            # first connection's timeout holds for the whole process (one spec per vLLM).
            os.environ.setdefault(name, value)
        client = MooncakeDistributedStore()
        worker = _DeadlineWorker(f"chunk-store-{spec.master_address}")
        deadline = max(_MIN_SETUP_DEADLINE_S, _SETUP_DEADLINE_FACTOR * spec.timeout_s)
        t0 = time.monotonic()
        status, result = worker.call(
            lambda: client.setup(
                spec.local_hostname,
                spec.metadata_server,
                spec.segment_bytes,
                spec.buffer_bytes,
                spec.protocol,
                "",
                spec.master_address,
            ),
            deadline,
        )
        if status != "ok" or result != 0:
            why = {
                "timeout": f"no answer within {deadline:.0f} s",
                "raised": f"raised {result!r}",
            }.get(status, f"setup returned {result}")
            worker.stop()
            raise RuntimeError(
                f"--chunk-store: cannot connect to the Mooncake master at "
                f"{spec.master_address} over {spec.protocol} ({why}); is "
                f"mooncake_master running there, and a mooncake_client lending memory?"
            )
        logger.info(
            "chunk store: connected to the Mooncake master at %s over %s in %.2f s "
            "(call deadline %.1f s, this process lends %d bytes)",
            spec.master_address, spec.protocol, time.monotonic() - t0, spec.timeout_s,
            spec.segment_bytes,
        )
        return cls(spec, client, worker)

    # -- the seam ---------------------------------------------------------------

    def register_buffer(self, buffer: HostBuffer) -> None:
        status, result = self._call(lambda: self._client.register_buffer(
            buffer.ptr, buffer.nbytes))
        if status != "ok" or result != 0:
            raise RuntimeError(
                f"chunk store: registering a {buffer.nbytes}-byte host buffer with the "
                f"Mooncake client failed ({status}, {result})"
            )

    def batch_exists(self, keys: Sequence[str]) -> list[Presence]:
        if not keys:
            return []
        status, result = self._call(lambda: self._client.batch_is_exist(list(keys)))
        if status != "ok" or len(result) != len(keys):
            return [Presence.ERROR] * len(keys)
        out = []
        for code in result:
            if code == 1:
                out.append(Presence.PRESENT)
            elif code == 0:
                out.append(Presence.ABSENT)
            else:
                out.append(Presence.ERROR)
        self.stats.errors += sum(p is Presence.ERROR for p in out)
        return out

    def batch_get_into(
        self, keys: Sequence[str], buffers: Sequence[HostBuffer]
    ) -> list[int]:
        return self._transfer(self._client.batch_get_into, keys, buffers, get=True)

    def batch_put_from(
        self, keys: Sequence[str], buffers: Sequence[HostBuffer]
    ) -> list[int]:
        return self._transfer(self._client.batch_put_from, keys, buffers, get=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker.busy():
            # NOTE: closing the client under a call that is still running could
            # crash the process; leak the connection instead (the process is
            # usually exiting).
            logger.warning("chunk store: closing while a call to %s is still running; "
                           "the connection is left open", self.spec.master_address)
            return
        self._worker.call(self._client.close, self.spec.timeout_s)
        self._worker.stop()

    # -- beyond the seam -----------------------------------------------------

    def remove(self, key: str) -> int:
        """Remove one key (tests, tools); 0 or a negative StoreCode."""
        status, result = self._call(lambda: self._client.remove(key))
        if status != "ok":
            return self._failure_code(status)
        if result == 0:
            return 0
        return StoreCode.ABSENT if result == _MC_OBJECT_NOT_FOUND else StoreCode.ERROR

    def idle(self) -> bool:
        """No call is running (a timed-out one may still be)."""
        return not self._worker.busy()

    def wait_idle(self, timeout_s: float) -> bool:
        return self._worker.wait_idle(timeout_s)

    # -- internals ------------------------------------------------------------

    def _call(self, fn: Callable[[], Any]) -> tuple[str, Any]:
        if self._closed:
            return "closed", None
        self.stats.calls += 1
        status, result = self._worker.call(fn, self.spec.timeout_s)
        if status == "timeout":
            self.stats.timeouts += 1
            self._stuck_since = time.monotonic()
            logger.warning(
                "chunk store: a call to the Mooncake master at %s did not answer within "
                "%.1f s; store reads and writes are misses until it returns",
                self.spec.master_address, self.spec.timeout_s)
        elif status == "busy":
            self.stats.refused_while_stuck += 1
        elif status == "raised":
            self.stats.errors += 1
            logger.warning("chunk store: a Mooncake call raised %r", result)
        elif self._stuck_since is not None:
            logger.info("chunk store: the Mooncake store at %s answers again (a call was "
                        "stuck for %.1f s)", self.spec.master_address,
                        time.monotonic() - self._stuck_since)
            self._stuck_since = None
        return status, result

    def _transfer(self, method, keys: Sequence[str], buffers: Sequence[HostBuffer], *,
                  get: bool) -> list[int]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        status, result = self._call(lambda: method(
            list(keys), [b.ptr for b in buffers], [b.nbytes for b in buffers]))
        if status != "ok":
            return [self._failure_code(status)] * len(keys)
        return self._map_codes(result, len(keys), get=get)

    def _failure_code(self, status: str) -> int:
        if status in ("timeout", "busy"):
            return StoreCode.TIMEOUT
        if status == "closed":
            return StoreCode.CLOSED
        return StoreCode.ERROR

    def _map_codes(self, result: Any, n: int, *, get: bool) -> list[int]:
        if not isinstance(result, list) or len(result) != n:
            self.stats.errors += n
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
                self.stats.errors += 1
                out.append(StoreCode.ERROR)
        return out

