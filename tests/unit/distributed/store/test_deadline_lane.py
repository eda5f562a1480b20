"""DeadlineLane (issue 39, findings 1 and 6): a call's memory is the call's
until it has really returned, and one kind of call never waits behind another.

The Mooncake client is replaced by an object whose calls block until the test
releases them: these tests are about the deadline bookkeeping around it; the
same contract on the real store is in test_mooncake_store.py."""

from __future__ import annotations

import threading
import time

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.base import (
    HostBuffer,
    Presence,
    StoreCode,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.deadline import (
    CallStatus,
    DeadlineLane,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.mooncake import (
    MooncakeChunkStore,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.spec import (
    parse_store_spec,
)


class Counter:
    def __init__(self):
        self.n = 0
        self.lock = threading.Lock()

    def __call__(self):
        with self.lock:
            self.n += 1


def test_a_call_on_time_returns_its_memory_before_it_returns():
    lane = DeadlineLane("t")
    released = Counter()
    result = lane.call(lambda: 7, 5.0, released)
    assert result.status is CallStatus.OK and result.value == 7 and released.n == 1
    lane.stop()


def test_a_timed_out_call_keeps_its_memory_until_it_returns():
    lane = DeadlineLane("t")
    go = threading.Event()
    released = Counter()
    result = lane.call(lambda: go.wait(30), 0.1, released)
    assert result.status is CallStatus.TIMEOUT
    time.sleep(0.2)
    assert released.n == 0  # still running: its memory is not the caller's
    # A call meanwhile is refused at once (and its memory is returned at once).
    refused = Counter()
    assert (
        lane.call(lambda: 1, 0.1, refused).status is CallStatus.BUSY and refused.n == 1
    )
    go.set()
    assert lane.wait_idle(5)
    deadline = time.monotonic() + 5
    while released.n == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert released.n == 1
    assert lane.call(lambda: 2, 1.0).value == 2
    lane.stop()


def test_memory_is_returned_exactly_once_when_calls_end_at_their_deadline():
    """Calls that end around their deadline: whoever sees the end (caller or
    lane) returns the memory, never both, never neither."""
    lane = DeadlineLane("t")
    released = Counter()
    calls = 0
    for i in range(200):
        lane.wait_idle(5)
        status = lane.call(lambda: time.sleep(0.002), 0.002, released).status
        assert status in (CallStatus.OK, CallStatus.TIMEOUT, CallStatus.BUSY)
        calls += 1
    lane.wait_idle(5)
    time.sleep(0.05)
    assert released.n == calls
    lane.stop()


class BlockingClient:
    """Mooncake's client API; puts block until `unblock` is set."""

    def __init__(self):
        self.unblock = threading.Event()

    def batch_put_from(self, keys, ptrs, sizes):
        self.unblock.wait(30)
        return [0] * len(keys)

    def batch_get_into(self, keys, ptrs, sizes):
        return list(sizes)

    def batch_is_exist(self, keys):
        return [1] * len(keys)


def test_reads_and_lookups_do_not_wait_behind_a_stuck_put():
    spec = parse_store_spec("mooncake://127.0.0.1:1?timeout=0.5&local_client=none")
    client = BlockingClient()
    store = MooncakeChunkStore(spec, client)
    buf = HostBuffer(0, 64)
    put_done = []
    t = threading.Thread(
        target=lambda: put_done.append(store.batch_put_from(["k"], [buf]))
    )
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    assert store.batch_get_into(["k"], [buf]) == [64]
    assert store.batch_exists(["k"]) == [Presence.PRESENT]
    assert time.monotonic() - t0 < 0.4  # neither waited for the put's lane
    t.join(5)
    assert put_done == [[StoreCode.TIMEOUT]]
    client.unblock.set()
    assert store.wait_idle(5)
