# SPDX-License-Identifier: Apache-2.0
"""A worker's store report after close: a fingerprint close() cancelled before
it ran leaves the rank without an identity, never an exception."""

from __future__ import annotations

import threading

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (
    StoreStep,
)

from tests.unit.distributed.store.test_store_connection import Client
from tests.unit.distributed.store.test_store_transfers import small_pool, transfers


def test_a_report_after_close_cancelled_a_queued_fingerprint():
    started, finish = threading.Event(), threading.Event()

    def fingerprint(model) -> str:
        started.set()
        finish.wait(10)
        return "w"

    t = transfers(
        "mooncake://127.0.0.1:47235?arena=1MB&local_client=none",
        small_pool(),
        store=Client({}),
        fingerprint=fingerprint,
    )
    assert started.wait(10)
    t.on_step(StoreStep(epoch=1))  # epoch 1's fingerprint waits behind epoch 0's
    t.close(0.0)
    finish.set()
    assert t.identity is None
    report = t.take_report()
    assert report is None or not report.identities
