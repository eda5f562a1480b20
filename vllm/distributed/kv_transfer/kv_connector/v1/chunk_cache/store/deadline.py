# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeadlineLane: one thread that runs a kind of store call, each caller
waiting at most its deadline.

A call past its deadline is TIMEOUT to its caller but keeps running inside
Mooncake, where it may still use its memory. So every call takes `on_return`,
run exactly once when the call has really returned: that, never the deadline,
frees its memory. A lane whose call is stuck refuses new calls at once (BUSY)
until it returns, so calls never pile up behind it.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .base import no_release


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


class _Job:
    __slots__ = ("fn", "on_return", "done", "result", "error", "abandoned", "lock")

    def __init__(self, fn: Callable[[], Any], on_return: Callable[[], None]):
        self.fn = fn
        self.on_return = on_return
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        # Set by a caller that gave up waiting; read with `done` under `lock`.
        self.abandoned = False
        self.lock = threading.Lock()

    def release(self) -> None:
        """Run on_return once (the caller on time, or the lane's thread late)."""
        with self.lock:
            on_return, self.on_return = self.on_return, no_release
        on_return()


class DeadlineLane:
    """A daemon thread running one call at a time (an executor's threads are
    joined at exit: one call stuck in Mooncake would hang the exit)."""

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
            except BaseException as e:  # handed to the caller
                job.error = e
            # A caller that gave up before this left on_return to this thread.
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
        on_return: Callable[[], None] = no_release,
    ) -> CallResult:
        # The deadline covers the wait for another thread's call too.
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
