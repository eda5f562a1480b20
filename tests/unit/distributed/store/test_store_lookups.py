"""StoreClient's lookups against a real Mooncake Store (issue 39, finding 4):
a stopped master costs a lookup at most its deadline (then the document is
computed), and connecting is never on a path a request waits on."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tests.store_fleet import MooncakeFleet, free_port
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.lookups import (
    StoreClient,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (
    RankIdentity,
    StoreReport,
)
from vllm.v1.core.chunk_hash_index import ChunkNamespace
from vllm.v1.core.chunk_store_probe import StoreAnswer

NS = ChunkNamespace(model="m", kv_dtype="f32", tokenizer="t", weights_epoch=0)
# A lookup call itself (the scheduler's step pays it) never blocks.
CALL_S = 0.05


def client(spec_text: str) -> StoreClient:
    config = SimpleNamespace(
        chunk_cache_config=SimpleNamespace(chunk_store=spec_text),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    c = StoreClient(config)
    c.on_report(StoreReport(identities=[RankIdentity(
        epoch=0, tp_rank=0, pp_rank=0, model="m", weights_version="w", kv_dtype="f32",
        kv_layout="l", rope="r", compute="c")]))
    return c


def answer(c: StoreClient, segment: list[int], limit_s: float) -> tuple[StoreAnswer, float]:
    """Ask as the scheduler does (a lookup, then the step's flush) until the
    answer is not PENDING; (answer, seconds)."""
    t0 = time.monotonic()
    while True:
        t = time.monotonic()
        got = c.lookup(segment, [1], NS).answer
        c.flush()
        assert time.monotonic() - t < CALL_S, "a lookup blocked the step"
        if got is not StoreAnswer.PENDING:
            return got, time.monotonic() - t0
        assert time.monotonic() - t0 < limit_s, "no answer"
        time.sleep(0.002)


def test_a_stopped_master_costs_a_lookup_at_most_its_deadline(tmp_path):
    with MooncakeFleet(tmp_path, timeout_s=3.0, lookup_timeout_s=0.1) as fleet:
        c = client(fleet.spec_text)
        assert c._shared.wait_connected(30)
        # Live: an absent key is answered by the store.
        got, _ = answer(c, [5, 6, 7], limit_s=5)
        assert got is StoreAnswer.MISS
        assert c.counters.store_misses_absent == 1 and c.counters.store_lookup_timeouts == 0
        fleet.stop_master()
        try:
            got, took = answer(c, [8, 9], limit_s=5)
            assert got is StoreAnswer.MISS and took < 0.1 + 0.25, took
            assert c.counters.store_lookup_timeouts == 1
            # Meanwhile the query is stuck: later lookups miss at their deadline too.
            got, took = answer(c, [10, 11], limit_s=5)
            assert got is StoreAnswer.MISS and took < 0.1 + 0.25, took
        finally:
            fleet.continue_master()
        c.close()


def test_connecting_is_never_on_the_lookup_path():
    """No master at all: the connection is tried on its own thread (and again
    later); every lookup returns at once and misses at its deadline."""
    c = client(f"mooncake://127.0.0.1:{free_port()}?timeout=2&lookup_timeout=0.1&local_client=none")
    for segment in ([5, 6], [7, 8], [9, 10]):
        got, took = answer(c, segment, limit_s=5)
        assert got is StoreAnswer.MISS and took < 0.1 + 0.25, took
    c.close()
