"""ReadCost (issue 39, "when is a store read worth it?"): a store hit is read
only when its expected read time, at the bandwidth the workers measured, is
below the expected compute time at the prefill rate this replica measured."""

from types import SimpleNamespace

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.lookups import (
    StoreClient,
    _Answer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (
    RankIdentity,
    StoreReport,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.read_cost import (
    EXPLORE_EVERY,
    ReadCost,
)
from vllm.v1.core.chunk_store_probe import StoreAnswer, StoreLookup
from vllm.v1.core.chunk_structures import ChunkNamespace


def test_reads_are_taken_until_both_sides_are_measured():
    cost = ReadCost()
    assert cost.decide(1000, 1001).read
    cost.note_row_bytes(128 << 10)
    cost.note_read_bandwidth(1e9)
    assert cost.decide(1000, 1001).read  # no compute rate yet


def test_a_read_slower_than_the_compute_is_skipped_but_explored():
    cost = ReadCost()
    cost.note_row_bytes(128 << 10)  # Llama-3-8B, bf16
    cost.note_read_bandwidth(0.3e9)  # TCP over loopback, measured here
    cost.note_compute(8000, 0.5)  # 16k tokens/s
    d = cost.decide(8000, 8001)
    assert not d.read and d.expected_read_s > d.expected_compute_s
    assert abs(d.expected_read_s - 8000 * (128 << 10) / 0.3e9) < 1e-9
    reads = [cost.decide(8000, 8001).read for _ in range(2 * EXPLORE_EVERY)]
    assert sum(reads) == 2  # once in EXPLORE_EVERY, to measure again
    cost.note_read_bandwidth(20e9)  # RDMA-class
    assert cost.decide(8000, 8001).read


def test_the_client_turns_a_hit_slower_than_computing_into_a_miss():
    config = SimpleNamespace(
        chunk_cache_config=SimpleNamespace(
            chunk_store="mooncake://127.0.0.1:1?lookup_timeout=60&local_client=none"
        ),
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
                    row_bytes=1 << 20,
                )
            ],
            read_bytes_per_s=1e6,
        )
    )
    c.note_child_computed(100, 0.01)
    ns = ChunkNamespace(model="m", kv_dtype="f32", tokenizer="t", weights_epoch=0)
    segment = list(range(5, 105))
    assert c.lookup(segment, [1], ns).answer is StoreAnswer.PENDING
    (lookup_id,) = c._asked
    c._asked.clear()
    import time

    c._answers[lookup_id] = _Answer(
        StoreLookup(StoreAnswer.HIT, lookup_id[1]), time.monotonic(), None, ""
    )
    assert c.lookup(segment, [1], ns).answer is StoreAnswer.MISS
    assert c.counters.store_reads_skipped_slower == 1
    assert (
        c.counters.store_expected_read_seconds
        > c.counters.store_expected_compute_seconds
    )
    c.close()
