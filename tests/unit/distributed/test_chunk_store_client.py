# SPDX-License-Identifier: Apache-2.0
"""The store path's bookkeeping without a store (issue 31): a fetch is decided
only when every rank reported (any failure -> a miss by cause), identities
gate lookups, worker reports combine over ranks, and the host arena carves
and merges spans. The real store is exercised in tests/e2e/test_chunk_store.py."""

from types import SimpleNamespace

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.arena import (
    ALIGN,
    HostArena,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.lookups import (
    StoreClient,
    store_content_hash,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (
    CAUSE_VERIFY_FAILED,
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


def client(tp: int, lookup_timeout: float = 600) -> StoreClient:
    config = SimpleNamespace(
        chunk_cache_config=SimpleNamespace(
            chunk_store=f"mooncake://127.0.0.1:1?lookup_timeout={lookup_timeout}&local_client=none"
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, pipeline_parallel_size=1
        ),
    )
    return StoreClient(config)


def identity(rank: int, epoch: int = 0) -> RankIdentity:
    return RankIdentity(
        epoch=epoch,
        tp_rank=rank,
        pp_rank=0,
        model="m",
        weights_version="w",
        kv_dtype="f32",
        kv_layout="l",
        rope="r",
        compute="c",
    )


def fetch(c: StoreClient, fid: str) -> None:
    c.start_fetch(FetchSpec(fid, b"h" * 16, [1, 2, 3], 1, 7, 0), [0])


def test_a_fetch_counts_only_when_every_rank_reported():
    c = client(tp=2)
    fetch(c, "f-ok")
    fetch(c, "f-bad")
    # Rank 0 finishes both in one step, rank 1 in a later one.
    assert c.on_report(
        StoreReport(outcomes={"f-ok": [FETCH_OK], "f-bad": [FETCH_OK]})
    ) == (ReportResult())
    result = c.on_report(
        StoreReport(outcomes={"f-ok": [FETCH_OK]}).aggregate(
            StoreReport(outcomes={"f-bad": [CAUSE_VERIFY_FAILED]})
        )
    )
    assert result == ReportResult(
        done=("f-ok",),
        failed=(FetchFailure("f-bad", CAUSE_VERIFY_FAILED, rows_held=False),),
    )
    counters = c.counters.take()
    assert counters["store_hits"] == 1 and counters["store_misses_verify_failed"] == 1
    assert "store_hits" not in c.counters.take()  # increments: nothing new
    step = c.take_step(epoch=0)
    assert [f.fetch_id for f in step.fetches] == ["f-ok", "f-bad"]
    c.close()


def test_lookups_wait_for_every_ranks_identity_of_the_epoch():
    c = client(tp=2)
    ns = ChunkNamespace(model="m", kv_dtype="f32", tokenizer="t", weights_epoch=0)
    assert c.lookup([5, 6], [1], ns).answer == StoreAnswer.PENDING
    c.on_report(StoreReport(identities=[identity(0)]))
    assert c.lookup([5, 6], [1], ns).answer == StoreAnswer.PENDING
    c.on_report(StoreReport(identities=[identity(1)]))
    # Identities known: the key is queued for this step's query (still pending).
    assert c.lookup([5, 6], [1], ns).answer == StoreAnswer.PENDING
    assert len(c._asked) == 1 and len(next(iter(c._asked.values()))[0]) == 2
    # A new epoch needs new identities.
    ns1 = ChunkNamespace(model="m", kv_dtype="f32", tokenizer="t", weights_epoch=1)
    assert c.lookup([5, 6], [1], ns1).answer == StoreAnswer.PENDING
    assert len(c._asked) == 1
    c.close()


def test_an_entry_computed_before_a_reset_is_not_written():
    c = client(tp=1)
    c.queue_put([1, 5, 6], 1, None, "", [3], epoch=0)
    c.queue_put([1, 7, 8], 1, None, "", [4], epoch=0)
    assert [p.pool_block_ids for p in c.take_step(epoch=0).puts] == [(3,), (4,)]
    c.queue_put([1, 9], 1, None, "", [5], epoch=0)
    assert c.take_step(epoch=1).puts == []
    c.close()


def test_content_hash_ignores_local_paths_but_not_the_tenant():
    a = store_content_hash([5, 6], [1], None, "")
    assert a == store_content_hash([5, 6], [1], None, "")
    assert a != store_content_hash([5, 6], [1], "", "")
    assert a != store_content_hash([5, 6], [1], None, "lora")
    assert a != store_content_hash([5, 6], [], None, "")
    assert a != store_content_hash([1, 5], [6], None, "")


def test_host_arena_carves_aligned_spans_and_merges_them_back():
    arena = HostArena(1 << 12)
    a = arena.allocate(100, tail_align_at=36)
    b = arena.allocate(1000)
    assert a is not None and b is not None
    assert (a + 36) % ALIGN == 0 and b % ALIGN == 0
    assert arena.allocate(4000) is None
    arena.free(a)
    arena.free(b)
    assert arena.in_use() == 0
    assert arena.allocate((1 << 12) - ALIGN) is not None
