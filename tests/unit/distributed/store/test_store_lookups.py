"""StoreClient's lookups against a real Mooncake Store (issue 39, finding 4):
a stopped master costs a lookup at most its deadline (then the document is
computed), and connecting is never on a path a request waits on. And its
reports without a store (finding 9): a failed fetch whose rows a rank's call
still holds says so, and says when every rank returned them."""

from __future__ import annotations

import time
from types import SimpleNamespace

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.lookups import (
    StoreClient,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (
    CAUSE_ABSENT,
    CAUSE_TIMEOUT,
    FETCH_OK,
    RankIdentity,
    StoreReport,
)
from vllm.v1.core.chunk_store_probe import (
    FetchFailure,
    FetchSpec,
    ReportResult,
    StoreAnswer,
)
from vllm.v1.core.chunk_structures import ChunkNamespace

from tests.store_fleet import MooncakeFleet, free_port

NS = ChunkNamespace(model="m", kv_dtype="f32", tokenizer="t", weights_epoch=0)
# A lookup call itself (the scheduler's step pays it) never blocks.
CALL_S = 0.05


def client(spec_text: str) -> StoreClient:
    config = SimpleNamespace(
        chunk_cache_config=SimpleNamespace(chunk_store=spec_text),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1
        ),
    )
    c = StoreClient(config)
    c.on_report(
        StoreReport(
            identities=[
                RankIdentity(
                    epoch=0,
                    tp_rank=0,
                    pp_rank=0,
                    model="m",
                    weights_version="w",
                    kv_dtype="f32",
                    kv_layout="l",
                    rope="r",
                    compute="c",
                )
            ]
        )
    )
    return c


def answer(
    c: StoreClient, segment: list[int], limit_s: float
) -> tuple[StoreAnswer, float]:
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
        assert (
            c.counters.store_misses_absent == 1
            and c.counters.store_lookup_timeouts == 0
        )
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
    c = client(
        f"mooncake://127.0.0.1:{free_port()}?timeout=2&lookup_timeout=0.1&local_client=none"
    )
    for segment in ([5, 6], [7, 8], [9, 10]):
        got, took = answer(c, segment, limit_s=5)
        assert got is StoreAnswer.MISS and took < 0.1 + 0.25, took
    c.close()


# ------------------------------------------------ lent rows (finding 9)


def ranks_client(tp: int) -> StoreClient:
    """A client of `tp` ranks whose store is never reached (reports only)."""
    config = SimpleNamespace(
        chunk_cache_config=SimpleNamespace(
            chunk_store=f"mooncake://127.0.0.1:{free_port()}?lookup_timeout=600&local_client=none"
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, pipeline_parallel_size=1
        ),
    )
    return StoreClient(config)


def start(c: StoreClient, fid: str) -> None:
    c.start_fetch(FetchSpec(fid, b"h" * 16, [1, 2, 3], 1, 7, 0), [4, 5])


def held(fid: str, cause=CAUSE_TIMEOUT) -> ReportResult:
    return ReportResult(failed=(FetchFailure(fid, cause, rows_held=True),))


def test_a_timed_out_ranks_rows_are_held_until_it_returns_them():
    c = ranks_client(tp=2)
    start(c, "f")
    # Rank 0 gave up at its deadline; its call still holds the rows.
    assert (
        c.on_report(StoreReport(outcomes={"f": [CAUSE_TIMEOUT]}, rows_lent={"f": 1}))
        == ReportResult()
    )
    # Rank 1's outcome decides the fetch: failed, with its rows held.
    assert c.on_report(StoreReport(outcomes={"f": [FETCH_OK]})) == held("f")
    assert c.counters.store_misses_timeout == 1 and c.counters.store_hits == 0
    assert c.on_report(StoreReport()) == ReportResult()  # still held
    assert c.on_report(StoreReport(rows_returned={"f": 1})) == ReportResult(
        rows_returned=("f",)
    )
    # Said once; a return for a fetch not held any more is ignored.
    assert c.on_report(StoreReport(rows_returned={"f": 1})) == ReportResult()
    assert c._lent == {}
    c.close()


def test_rows_held_by_several_ranks_are_returned_when_the_last_one_returns():
    c = ranks_client(tp=2)
    start(c, "f")
    both = StoreReport(outcomes={"f": [CAUSE_TIMEOUT]}, rows_lent={"f": 1}).aggregate(
        StoreReport(outcomes={"f": [CAUSE_TIMEOUT]}, rows_lent={"f": 1})
    )
    assert both.rows_lent == {"f": 2}
    assert c.on_report(both) == held("f")
    assert c.on_report(StoreReport(rows_returned={"f": 1})) == ReportResult()
    assert c.on_report(StoreReport(rows_returned={"f": 1})) == ReportResult(
        rows_returned=("f",)
    )
    c.close()


def test_a_rank_that_returned_before_the_fetch_was_decided_holds_nothing():
    c = ranks_client(tp=3)
    start(c, "f")
    start(c, "g")
    # f: rank 0 times out and its call returns before the others report.
    assert (
        c.on_report(StoreReport(outcomes={"f": [CAUSE_TIMEOUT]}, rows_lent={"f": 1}))
        == ReportResult()
    )
    assert c.on_report(StoreReport(rows_returned={"f": 1})) == ReportResult()
    # g: rank 0 lends and returns in one report.
    assert (
        c.on_report(
            StoreReport(
                outcomes={"g": [CAUSE_TIMEOUT]},
                rows_lent={"g": 1},
                rows_returned={"g": 1},
            )
        )
        == ReportResult()
    )
    # Decided: f's rank 1 times out too and still holds its rows; g holds none.
    result = c.on_report(
        StoreReport(
            outcomes={"f": [CAUSE_ABSENT, CAUSE_TIMEOUT], "g": [FETCH_OK] * 2},
            rows_lent={"f": 1},
        )
    )
    assert result == ReportResult(
        failed=(
            FetchFailure("f", CAUSE_TIMEOUT, rows_held=True),
            FetchFailure("g", CAUSE_TIMEOUT, rows_held=False),
        )
    )
    assert c.on_report(StoreReport(rows_returned={"f": 1, "g": 1})) == ReportResult(
        rows_returned=("f",)
    )
    c.close()


def test_returns_and_loans_of_unknown_fetches_are_ignored():
    c = ranks_client(tp=1)
    assert c.on_report(StoreReport(rows_returned={"nope": 1})) == ReportResult()
    assert c.on_report(StoreReport(rows_lent={"nope": 1})) == ReportResult()
    assert c._lent == {}
    # A fetch every rank completed is done; no rows are held for it.
    start(c, "f")
    assert c.on_report(
        StoreReport(outcomes={"f": [FETCH_OK]}, rows_returned={"f": 1})
    ) == ReportResult(done=("f",))
    c.close()
