"""A late store write into pool rows that serve another document (issue 50).

A read straight into pool rows that the step gave up on may still be written by
Mooncake until its call returns; the scheduler holds those blocks until then
(issue 39, finding 9). test_chunk_store.py's holder-stopped test resumes the holder
only after `generate` returned and resets before it checks again, so a late write
into reused rows could never reach an answer there. Here it would: the pool has
exactly the room X's fetches need to be computed elsewhere, the next request Y
needs more than that leaves (so it must evict, and would evict X's documents),
the holder resumes once Y waits for X's held rows (or, with the rows-held rule
reverted, once Y was computed into them), and Y is then served from the pool and
compared with the HF reference.

NOTE: the holder resumes while Y waits, not after Y was computed: with the rule,
Y can only be computed once X's calls returned, and a get Mooncake failed (its
60 s transfer wait, the holder still stopped) never returns its rows now (its
transport may still write into them: mooncake._RETIRED); they are written off
at `held_limit` and the pool shrinks below what Y needs. Resumed within seconds,
the calls complete (the late write lands in the held rows) and return them.
`held_limit` is short so that a failed get makes this fail (Y refused) in about
a minute instead of waiting for the default 300 s.

Engine W writes X's documents to a real Mooncake Store (its client in process,
`direct_reads=1`: reads land in the pool rows, what this test is about; by
default they land in the get arena and hold no rows), then engine R (small
pool) serves. About 1 min here.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import models_dir
from tests.e2e.chunk_reference import Layout, Reference, random_text
from tests.e2e.engine import chunk_scheduler, close_llm, make_llm
from tests.e2e.test_chunk_cache_engine import check, params
from tests.e2e.test_chunk_store import counters, drain_puts, worker_store
from tests.store_fleet import MooncakeFleet

pytestmark = pytest.mark.e2e

MODEL = str(models_dir() / "tiny-llama")
POOL_BLOCK = 16
# Far above when the holder resumes (seconds after X's reads hung), far below the
# default 300 s (see the module's NOTE).
HELD_LIMIT_S = 45


def _blocks(reference: Reference, layout: Layout) -> tuple[int, int]:
    """(pool blocks of the layout's cached segments, of its documents alone)."""
    from vllm.v1.core.chunk_cache_manager import pool_blocks_for

    prompt = reference.chunked_prompt(layout)
    total = pool_blocks_for(prompt, POOL_BLOCK, "sink")
    system = -(-prompt.spans[0].num_tokens // POOL_BLOCK)
    return total, total - system


def test_a_late_write_never_reaches_a_document_served_from_reused_rows(tmp_path):
    reference = Reference(MODEL)
    rng = random.Random("late-write")
    docs = [random_text(rng, 25) for _ in range(5)]
    x = Layout("sys", docs[:2], "what is in x")
    y = Layout("sys", docs[2:], "what is in y")
    x_total, x_docs = _blocks(reference, x)
    y_total, y_docs = _blocks(reference, y)
    # Room for X, and for every segment of X once more (all three are read from the
    # store and relocated); Y's documents need more than X takes, so Y must evict
    # (X's documents are then the only candidates), and fit once the held blocks
    # are back.
    pool_blocks = 2 * x_total
    assert x_total < y_docs <= x_total + x_docs and y_total <= pool_blocks, (
        x_total,
        x_docs,
        y_docs,
    )
    with MooncakeFleet(
        tmp_path / "mooncake", lookup_timeout_s=5.0, timeout_s=10.0
    ) as fleet:
        kwargs = dict(
            enable_chunk_cache=True,
            chunk_context="sink",
            chunk_store=(
                fleet.spec_text + f"&held_limit={HELD_LIMIT_S:g}&direct_reads=1"
            ),
            max_model_len=1024,
        )
        w = make_llm(MODEL, **kwargs)
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
                pool_bytes_per_token,
            )

            row_bytes = pool_bytes_per_token(w.llm_engine.vllm_config)
            check(reference, x, w.generate([x.prompt], params(), use_tqdm=False)[0])
            drain_puts(w)
        finally:
            close_llm(w)
        r = make_llm(
            MODEL,
            chunk_pool_size_gib=pool_blocks
            * POOL_BLOCK
            * row_bytes
            / (1 << 30)
            * 1.0001,
            **kwargs,
        )
        try:
            assert chunk_scheduler(r).manager.pool.num_blocks == pool_blocks
            assert worker_store(r).reads_into_pool()
            fleet.stop_client()
            resumed = False
            try:
                # X's documents are store hits whose reads hang: given up, computed.
                check(reference, x, r.generate([x.prompt], params(), use_tqdm=False)[0])
                assert counters(r)["store_misses_timeout"] >= 1
                assert worker_store(r).lent_bytes() > 0, "no read still in Mooncake"
                # Y must evict to be computed; X's documents are the only candidates.
                # It waits for X's held rows (deferred) until the holder resumes.
                manager = chunk_scheduler(r).manager
                deferred = manager._stats.deferred_requests
                with ThreadPoolExecutor(1) as thread:
                    y_first = thread.submit(
                        r.generate, [y.prompt], params(), use_tqdm=False
                    )
                    deadline = time.monotonic() + 30
                    while (
                        not y_first.done()
                        and manager._stats.deferred_requests == deferred
                    ):
                        assert time.monotonic() < deadline, "Y neither waited nor ran"
                        time.sleep(0.05)
                    fleet.continue_client()
                    resumed = True
                    y_out = y_first.result(timeout=120)[0]
                assert counters(r)["refused_requests"] == 0, "Y refused"
                check(reference, y, y_out)
            finally:
                if not resumed:
                    fleet.continue_client()
            # The calls return (a late write lands where the store was told to write).
            store = worker_store(r)
            deadline = time.monotonic() + 60
            while store.lent_bytes():
                assert time.monotonic() < deadline, store.lent_bytes()
                r.generate(["x ## y ## drain"], params(1), use_tqdm=False)
                time.sleep(0.2)
            # Y again: from the pool, whatever the late writes touched.
            before = counters(r)
            check(reference, y, r.generate([y.prompt], params(), use_tqdm=False)[0])
            after = counters(r)
            assert after["child_computes"] == before["child_computes"]
            assert (after["refused_requests"], after["store_reads_written_off"]) == (
                0,
                0,
            )
        finally:
            close_llm(r)
