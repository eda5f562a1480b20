# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Chunk-cache statistics in vLLM's connector stats pipeline: counter
increments and pool gauges, logged by vLLM's "KV Transfer metrics:" line and
exported to Prometheus as `vllm:chunk_cache_*`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.core.chunk_structures import ChunkCacheStats

# Monotonic counters (reported as increments) and their help text; the names
# are fields of ChunkCacheStats, whose one owner is ChunkCacheManager.
COUNTERS: dict[str, str] = {
    "hits": "Cached segments found resident in the chunk pool at admission",
    "misses": "Cached segments that needed a new child request",
    "in_flight_joins": "Cached segments that joined a child already computing them",
    "tokens_reused": "Prompt tokens of resident segments served from the chunk pool",
    "tokens_loaded": "Prompt tokens copied (re-positioned) from the pool to requests",
    "child_computes": "Internal child requests started to compute missing segments",
    "child_tokens": "Tokens prefilled by child requests (context included)",
    "evictions": "Chunk pool entries evicted (LRU)",
    "refused_requests": "Chunked requests refused after arrival",
    "deferred_requests": "Chunked requests that waited for chunk pool room",
    "hash_collisions": "Key matches whose stored tokens differed",
    "failed_children": "Child requests that ended without storing their rows",
}
# --chunk-store's counters, the scheduler's and the workers' (summed): every
# miss, timeout or refusal is computed instead.
STORE_COUNTERS: dict[str, str] = {
    "store_hits": "Missing segments read from the chunk store (every rank verified)",
    "store_misses_absent": "Store lookups or reads that found no entry",
    "store_misses_verify_failed": "Store reads whose header, tokens or checksum "
    "did not verify",
    "store_misses_error": "Store lookups or reads that failed",
    "store_misses_timeout": "Store lookups or reads past their deadline",
    "store_lookup_timeouts": "Store lookups not answered within the lookup deadline",
    "store_reads_given_up": "Store reads that missed their read deadline",
    "store_reads_never_started": "Store reads dropped before their call started, "
    "queued past their deadline behind another store call (nothing lent)",
    "store_reads_no_room": "Store reads refused for lack of read-arena room",
    "store_reads_skipped_slower": "Store hits computed instead: the read was "
    "expected to take longer than the compute",
    "store_expected_read_seconds": "Expected store read time of the hits decided "
    "with both estimates (sum)",
    "store_expected_compute_seconds": "Expected compute time of the same hits (sum)",
    "store_fetch_seconds": "Seconds from a store hit to every rank's entry in the "
    "pool (sum)",
    "store_gets": "Entries read, verified and written into the pool by a worker rank",
    "store_get_bytes": "Bytes read from the store by worker ranks",
    "store_get_seconds": "Seconds worker ranks spent in store reads (one call per "
    "step, summed)",
    "store_puts_queued": "Children's entries queued for writing to the store",
    "store_reads_written_off": "Failed store reads whose pool rows stayed lent "
    "past held_limit (written off)",
    "store_puts": "Entries written to the store by a worker rank",
    "store_put_bytes": "Bytes written to the store by worker ranks",
    "store_put_failures": "Entry writes the store refused or failed",
    "store_puts_skipped": "Entry writes skipped (no write-arena room, or weights "
    "loaded since the last reset)",
}
# Gauges (last value wins).
GAUGES: dict[str, str] = {
    "pool_blocks_used": "Chunk pool blocks in use",
    "pool_blocks_total": "Chunk pool blocks in total",
    "pool_entries_pinned": "Chunk pool entries pinned by requests in flight",
    "live_requests": "Chunked requests and child requests the chunk cache tracks",
    "pool_blocks_held": "Chunk pool blocks still lent to a failed store read's call",
}

# Gauge name -> the ChunkCacheStats field it reports.
_GAUGE_SOURCES = {name: name for name in GAUGES} | {
    "pool_entries_pinned": "pinned_entries"
}


@dataclass
class ChunkCacheConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    @classmethod
    def increments(
        cls, now: ChunkCacheStats, last: ChunkCacheStats
    ) -> ChunkCacheConnectorStats:
        """Counter increments from `last` to `now`, plus `now`'s gauges when
        anything changed: a changed gauge alone (the last pin dropping to 0)
        makes the report non-empty, which vLLM 0.32 needs to forward it."""
        data = {k: getattr(now, k) - getattr(last, k) for k in COUNTERS}
        if any(data.values()) or any(
            getattr(now, attr) != getattr(last, attr)
            for attr in _GAUGE_SOURCES.values()
        ):
            for gauge, attr in _GAUGE_SOURCES.items():
                data[gauge] = getattr(now, attr)
        return cls(data=data)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key in COUNTERS or key in STORE_COUNTERS:
                self.data[key] = self.data.get(key, 0) + value
            else:
                self.data[key] = value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: int(self.data.get(k, 0)) for k in COUNTERS}
        lookups = out["hits"] + out["misses"] + out["in_flight_joins"]
        out["hit_rate"] = round(
            (out["hits"] + out["in_flight_joins"]) / lookups if lookups else 0.0, 4
        )
        for k in GAUGES:
            if k in self.data:
                out[k] = int(self.data[k])
        for k in STORE_COUNTERS:
            if k in self.data:
                out[k] = (
                    round(float(self.data[k]), 4)
                    if k.endswith("seconds")
                    else int(self.data[k])
                )
        return out

    def is_empty(self) -> bool:
        return (
            not any(self.data.get(k) for k in COUNTERS)
            and not any(k in self.data for k in GAUGES)
            and not any(self.data.get(k) for k in STORE_COUNTERS)
        )


class ChunkCachePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:chunk_cache_{name}",
                documentation=doc,
                labelnames=labelnames,
            )
            for name, doc in (COUNTERS | STORE_COUNTERS).items()
        }
        self._gauges = {
            name: self._gauge_cls(
                name=f"vllm:chunk_cache_{name}",
                documentation=doc,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            for name, doc in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name].labels(*labels).inc(value)
            elif name in self._gauges:
                self._gauges[name].labels(*labels).set(value)
