# SPDX-License-Identifier: Apache-2.0
"""DeadlineLane: one thread that runs a kind of store call (existence queries,
reads, writes), each caller waiting at most its deadline.

A call that has not returned by its deadline is TIMEOUT to the caller, but it
keeps running inside Mooncake: memory given to it may still be read or written.
So every call takes an `on_return` callback, run exactly once when the call
has really returned (at once for a call on time or refused, later on the
lane's thread for one that timed out): that, never the deadline, is when the
caller may give the call's memory to anything else.

NOTE: one lane per kind of call, so a queue of writes never makes a read wait
(or fail "busy"); a lane whose call is stuck refuses new calls at once (BUSY)
until it returns, so calls never pile up behind a stuck one.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class CallStatus(enum.Enum):
    OK = "ok"
    TIMEOUT = "timeout"
    """Still running after the deadline (its on_return runs when it returns)."""
    BUSY = "busy"
    """Refused: an earlier call of this lane is still running (never started)."""
    RAISED = "raised"
    CLOSED = "closed"


@dataclass(frozen=True)
class CallResult:
    status: CallStatus
    value: Any = None
    """The call's return value (OK) or exception (RAISED)."""


def _noop() -> None:
    return None


class _Job:
    __slots__ = (
        "fn",
        "on_return",
        "done",
        "result",
        "error",
        "abandoned",
        "lock",
        "_returned_to",
    )

    def __init__(self, fn: Callable[[], Any], on_return: Callable[[], None]):
        self.fn = fn
        self.on_return = on_return
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        # Set by a caller that gave up waiting; read with `done` under `lock`.
        self.abandoned = False
        self.lock = threading.Lock()
        self._returned_to = False

    def release(self) -> None:
        """Run on_return once (the caller on time, or the lane's thread late)."""
        with self.lock:
            if self._returned_to:
                return
            self._returned_to = True
        self.on_return()


class DeadlineLane:
    """A daemon thread running one call at a time.

    NOTE: daemon, and not a ThreadPoolExecutor: the executor's threads are
    joined at interpreter exit, so one call stuck in Mooncake would hang the
    process's exit."""

    def __init__(self, name: str):
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._running: _Job | None = None
        self._lock = threading.Lock()
        self._stopped = False
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
            # NOTE: `done` and `abandoned` under one lock: a caller that gave up
            # before this point left on_return to this thread; one that did not
            # runs it itself.
            with job.lock:
                job.done.set()
                late = job.abandoned
            if late:
                job.release()

    def busy(self) -> bool:
        job = self._running
        return job is not None and not job.done.is_set()

    def call(
        self,
        fn: Callable[[], Any],
        deadline_s: float,
        on_return: Callable[[], None] = _noop,
    ) -> CallResult:
        # NOTE: the deadline covers the wait for another thread's call too.
        t_end = time.monotonic() + deadline_s
        if self._stopped:
            on_return()
            return CallResult(CallStatus.CLOSED)
        if not self._lock.acquire(timeout=deadline_s):
            on_return()
            return CallResult(CallStatus.BUSY)
        try:
            if self.busy():
                on_return()
                return CallResult(CallStatus.BUSY)
            job = _Job(fn, on_return)
            self._running = job
            self._jobs.put(job)
            if not job.done.wait(max(0.0, t_end - time.monotonic())):
                with job.lock:
                    job.abandoned = not job.done.is_set()
                if job.abandoned:
                    return CallResult(CallStatus.TIMEOUT)
            self._running = None
        finally:
            self._lock.release()
        job.release()
        if job.error is not None:
            return CallResult(CallStatus.RAISED, job.error)
        return CallResult(CallStatus.OK, job.result)

    def wait_idle(self, timeout_s: float) -> bool:
        job = self._running
        return job is None or job.done.wait(timeout_s)

    def stop(self) -> None:
        self._stopped = True
        self._jobs.put(None)
