# SPDX-License-Identifier: Apache-2.0
"""Issue 52: the connector's scheduler half runs no Python per token on an
all-hit request.

Real vLLM Request objects, no engine (as test_chunk_cache_scheduler_adapter.py):
the same request shape (a system prompt, eight documents shuffled, a question)
with documents of 16 and of 1,600 tokens, every document resident. Arrival, the
scheduler's match query, the allocation hook, the step's connector metadata and
the finish execute the same number of Python lines (`python_lines`: a count,
not a time). The workers' expansion of the metadata into rows has its own
test (test_chunk_cache_metadata.py).
"""

import random

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.scheduler_adapter import (
    ChunkCacheSchedulerAdapter,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from tests.unit.distributed.test_chunk_cache_scheduler_adapter import (
    BLOCK,
    FakeBlocks,
    finish,
    make_config,
    step_output,
)
from tests.unit.python_lines import python_lines

DOCS = 8


def _request(rid, system, docs, question) -> Request:
    segments = [system, *docs, question]
    ids = [t for seg in segments for t in seg]
    return Request(
        rid,
        ids,
        SamplingParams(max_tokens=1),
        None,
        chunk_layout=[len(s) for s in segments],
    )


def _all_hit_lines(doc_tokens: int) -> int:
    rng = random.Random(doc_tokens)
    system = [rng.randrange(2, 1000) for _ in range(doc_tokens)]
    docs = [[rng.randrange(2, 1000) for _ in range(doc_tokens)] for _ in range(DOCS)]
    num_tokens = (DOCS + 1) * doc_tokens + 3
    blocks = -(-num_tokens // BLOCK)
    adapter = ChunkCacheSchedulerAdapter(
        *make_config(num_kv_blocks=8 * blocks, fraction=0.5)
    )
    warm = _request("warm", system, docs, [5, 6, 7])
    adapter.on_new_request(warm)
    adapter.get_num_new_matched_tokens(warm, 0)
    for child in adapter.take_internal_requests():
        finish(adapter, child, RequestStatus.FINISHED_LENGTH_CAPPED)
    finish(adapter, warm, RequestStatus.FINISHED_STOPPED)
    loaded = (DOCS + 1) * doc_tokens
    # Built outside the counted call: the test's own lists are per token.
    requests = [
        _request(f"r{i}", system, rng.sample(docs, DOCS), [8, 9, 10]) for i in range(2)
    ]

    def request() -> None:
        r = requests.pop()
        adapter.on_new_request(r)
        assert adapter.get_num_new_matched_tokens(r, 0) == (loaded, False)
        adapter.update_state_after_alloc(
            r, FakeBlocks(list(range(1, blocks + 1))), loaded
        )
        meta = adapter.build_connector_meta(step_output({r.request_id: 3}))
        assert sum(s.num_rows for load in meta.loads for s in load.stretches) == loaded
        finish(adapter, r, RequestStatus.FINISHED_STOPPED)

    request()  # first-call imports and caches
    return python_lines(request)


def test_the_adapters_all_hit_path_runs_no_python_per_token():
    assert _all_hit_lines(1600) == _all_hit_lines(16)
