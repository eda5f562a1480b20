#!/usr/bin/env python3
"""Scheduler-side cost of one step's connector metadata (issue 20, finding 6).

Loads: one all-hit request of N documents of T tokens each is admitted, its
documents made resident, its blocks allocated; then the step's connector
metadata is built (`build_connector_meta`) and pickled, as vLLM sends it to
every worker. The step's hooks: the request's matched tokens, prefill gap,
allocation and that metadata build together (the scheduler side's host time
per step). Captures: the cold step where the N documents' children are
prefilled together. Prints the median time of each and the pickled size, for
N = 8 and 64 by default. No engine: the scheduler adapter alone, on the CPU.

    .cache/venv/bin/python benchmarks/bench_connector_meta.py [--docs 8 64]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from types import SimpleNamespace

BLOCK = 16
SINK = 1


class _Blocks:
    def __init__(self, block_ids):
        self.block_ids = block_ids

    def get_block_ids(self):
        return (self.block_ids,)


def _adapter(num_pool_tokens: int):
    import torch

    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.scheduler_adapter import (
        ChunkCacheSchedulerAdapter,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    chunk = SimpleNamespace(chunk_context="sink", chunk_sink_token_id=SINK,
                            chunk_pool_fraction=0.5, chunk_pool_size_gib=None,
                            chunk_recompute_tokens=0, max_chunk_load_tokens=1 << 20,
                            chunk_store=None)
    config = SimpleNamespace(
        chunk_cache_config=chunk,
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BLOCK),
        model_config=SimpleNamespace(model="m", tokenizer="t", dtype="float32"),
        scheduler_config=SimpleNamespace(get_scheduler_cls=lambda: Scheduler),
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)],
                         num_blocks=num_pool_tokens // BLOCK + 1)
    return ChunkCacheSchedulerAdapter(config, kv)


def _admitted(num_docs: int, doc_tokens: int):
    """An adapter that has admitted one request of N documents (its
    children spawned, not run), the request and its layout."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    layout = [8] + [doc_tokens] * num_docs + [16]
    total = sum(layout)
    adapter = _adapter(4 * total)
    ids = [10 + (i % 30000) for i in range(total)]
    parent = Request("p", ids, SamplingParams(max_tokens=2), None, chunk_layout=layout)
    adapter.on_new_request(parent)
    adapter.get_num_new_matched_tokens(parent, 0)
    return adapter, parent, layout


def measure(num_docs: int, doc_tokens: int, repeat: int) -> dict:
    from vllm.v1.request import RequestStatus

    adapter, parent, layout = _admitted(num_docs, doc_tokens)
    total = sum(layout)
    for child in adapter.take_internal_requests():
        child.status = RequestStatus.FINISHED_LENGTH_CAPPED
        child.num_computed_tokens = child.num_prompt_tokens
        adapter.request_finished(child)
    blocks = _Blocks(list(range(1, total // BLOCK + 2)))
    out = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=None,
                          num_scheduled_tokens={"p": 16}, preempted_req_ids=None)
    import torch

    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import LoadRows
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import POOL_BLOCK_SIZE

    build, dump, expand, former, hooks, size = [], [], [], [], [], 0
    for _ in range(repeat):
        th = time.perf_counter()
        matched, _ = adapter.get_num_new_matched_tokens(parent, 0)
        adapter.get_prefill_gap(parent, matched)
        adapter.update_state_after_alloc(parent, blocks, matched)
        t0 = time.perf_counter()
        meta = adapter.build_connector_meta(out)
        t1 = time.perf_counter()
        hooks.append(t1 - th)
        data = pickle.dumps(meta)
        t2 = time.perf_counter()
        # Each worker: block ids -> rows, on its device (here the CPU).
        rows = LoadRows.expand(meta.loads, POOL_BLOCK_SIZE, BLOCK, torch.device("cpu"))
        t3 = time.perf_counter()
        # What each worker did before (issue 20, finding 6): the same rows
        # shipped as three per-token lists, turned back into a tensor.
        lists = [rows.src_rows.tolist(), rows.dst_slots.tolist(), rows.deltas.tolist()]
        t4 = time.perf_counter()
        torch.tensor(lists, dtype=torch.int64)
        t5 = time.perf_counter()
        build.append(t1 - t0)
        dump.append(t2 - t1)
        expand.append(t3 - t2)
        former.append(t5 - t4)
        size = len(data)
    return {"docs": num_docs, "rows": rows.src_rows.numel(),
            "build_ms": 1e3 * statistics.median(build),
            "hooks_ms": 1e3 * statistics.median(hooks),
            "pickle_ms": 1e3 * statistics.median(dump), "bytes": size,
            "expand_ms": 1e3 * statistics.median(expand),
            "former_ms": 1e3 * statistics.median(former)}


def measure_captures(num_docs: int, doc_tokens: int, repeat: int) -> dict:
    """A cold step: the children of N documents prefilled together."""
    import torch

    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import StoreRows
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import POOL_BLOCK_SIZE

    adapter, _, _ = _admitted(num_docs, doc_tokens)
    children = adapter.take_internal_requests()
    new, scheduled, next_block = [], {}, 1
    for child in children:
        n = child.num_prompt_tokens
        num_blocks = -(-n // BLOCK)
        new.append(SimpleNamespace(req_id=child.request_id, num_computed_tokens=0,
                                   block_ids=(list(range(next_block, next_block + num_blocks)),)))
        next_block += num_blocks
        scheduled[child.request_id] = n
    out = SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens=scheduled,
                          scheduled_cached_reqs=SimpleNamespace(
                              req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                              num_computed_tokens=[]),
                          preempted_req_ids=None)
    build, dump, expand, size, rows = [], [], [], 0, 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        meta = adapter.build_connector_meta(out)
        t1 = time.perf_counter()
        data = pickle.dumps(meta)
        t2 = time.perf_counter()
        expanded = StoreRows.expand(meta.stores, POOL_BLOCK_SIZE, BLOCK, torch.device("cpu"))
        t3 = time.perf_counter()
        build.append(t1 - t0)
        dump.append(t2 - t1)
        expand.append(t3 - t2)
        size, rows = len(data), expanded.src_slots.numel()
    return {"docs": num_docs, "rows": rows,
            "build_ms": 1e3 * statistics.median(build),
            "pickle_ms": 1e3 * statistics.median(dump), "bytes": size,
            "expand_ms": 1e3 * statistics.median(expand)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--doc-tokens", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print("| documents | rows loaded | build_connector_meta (ms) | the step's hooks (ms) "
          "| pickle (ms) | pickled bytes "
          "| worker: expand to an index tensor (ms) | worker, per-token lists: torch.tensor (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.docs:
        r = measure(n, args.doc_tokens, args.repeat)
        print(f"| {r['docs']} | {r['rows']} | {r['build_ms']:.3f} | {r['hooks_ms']:.3f} "
              f"| {r['pickle_ms']:.3f} "
              f"| {r['bytes']} | {r['expand_ms']:.3f} | {r['former_ms']:.3f} |")
    print()
    print("Captures, a cold step (every document's child prefilled in it):")
    print("| documents | rows stored | build_connector_meta (ms) | pickle (ms) | pickled bytes "
          "| worker: expand to an index tensor (ms) |")
    print("|---|---|---|---|---|---|")
    for n in args.docs:
        r = measure_captures(n, args.doc_tokens, args.repeat)
        print(f"| {r['docs']} | {r['rows']} | {r['build_ms']:.3f} | {r['pickle_ms']:.3f} "
              f"| {r['bytes']} | {r['expand_ms']:.3f} |")


if __name__ == "__main__":
    main()
