"""The chunk cache's per-step stats report: counter increments and the gauges that
moved."""

from dataclasses import replace

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.stats import (
    ChunkCacheConnectorStats,
)
from vllm.v1.core.chunk_structures import ChunkCacheStats


def test_a_step_where_only_pins_drop_is_still_reported():
    # The step in which the last request finishes: no counter moves, its pins go.
    last = replace(
        ChunkCacheStats(),
        hits=3,
        pinned_entries=5,
        pool_blocks_total=40,
        pool_blocks_used=9,
        live_requests=1,
    )
    now = replace(last, pinned_entries=0, live_requests=0)
    report = ChunkCacheConnectorStats.increments(now, last)
    # vLLM 0.32 forwards a scheduler-side report only when it is not empty.
    assert not report.is_empty()
    assert report.data["pool_entries_pinned"] == 0 and report.data["live_requests"] == 0
    # Every gauge rides along (the log line shows them all), unchanged ones too.
    assert (report.data["pool_blocks_used"], report.data["pool_blocks_total"]) == (
        9,
        40,
    )
    assert report.reduce()["hits"] == 0


def test_an_idle_step_is_empty():
    now = replace(ChunkCacheStats(), hits=3, pinned_entries=2, pool_blocks_total=40)
    assert ChunkCacheConnectorStats.increments(now, now).is_empty()
    assert ChunkCacheConnectorStats().is_empty()  # the workers' report


def test_counters_add_up_and_gauges_keep_the_last_value_across_steps():
    s0 = ChunkCacheStats()
    s1 = replace(s0, hits=2, misses=1, pinned_entries=3, pool_blocks_total=40)
    s2 = replace(s1, hits=5, pinned_entries=1)
    total = ChunkCacheConnectorStats.increments(s1, s0).aggregate(
        ChunkCacheConnectorStats.increments(s2, s1)
    )
    out = total.reduce()
    assert (out["hits"], out["misses"]) == (5, 1)
    assert (out["pool_entries_pinned"], out["pool_blocks_total"]) == (1, 40)
