"""Two replicas of one LongRoPE model at two --max-model-len share a real
Mooncake Store (issue 50, finding 2).

A tiny random Phi-3 (LongRoPE, original_max_position_embeddings 1024; the
model-family matrix's `phi3`): vLLM rotates every position with the short
factors at --max-model-len 1024 and with the long ones at 2048. Replica A
(1024) computes four documents and writes them to the store; replica B (2048)
answers the same request. Before the fix B read A's entries (the HF rope fields
are the same) and served K rotated with the short factors. B must compute
every document itself and answer as replica C (2048, no store) does. The
control, replica D at 1024, reads A's entries: the store still serves where
the rotation is the same.

NOTE: the oracle for B is C (stock rotation at 2048 with the chunk cache, no
store), not the HF reference: above original_max_position_embeddings vLLM
itself differs from HF (families.py). Four engines of a 2-layer model.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.conftest import models_dir
from tests.e2e.chunk_reference import Layout, random_text
from tests.e2e.engine import chunk_scheduler, close_llm, make_llm
from tests.e2e.families import build
from tests.e2e.test_chunk_cache_engine import params
from tests.store_fleet import MooncakeFleet

# NOTE: slow tier (four engine starts, minutes of the CI budget): the default tier's
# tests/unit/distributed/store/test_store_rank_rotation.py checks the key against vLLM's
# own ropes; this one shows the served answers.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _counters(llm) -> dict:
    sched = chunk_scheduler(llm)
    stats = dataclasses.asdict(sched.manager.stats())
    if sched.store is not None:
        stats.update(dataclasses.asdict(sched.store.counters))
    return stats


def _drain_puts(llm, timeout_s: float = 30.0) -> None:
    import time

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    store = get_kv_transfer_group()._worker.store
    deadline = time.monotonic() + timeout_s
    while store._puts:
        llm.generate(["x ## y ## drain"], params(1), use_tqdm=False)
        assert time.monotonic() < deadline, "puts did not finish"
        time.sleep(0.05)


def _answer(model: str, max_model_len: int, layout: Layout, store: str | None):
    """(text, first-token logprobs, counters) of `layout` on a fresh replica."""
    kwargs = {"chunk_store": store} if store is not None else {}
    llm = make_llm(
        model,
        enable_chunk_cache=True,
        chunk_context="sink",
        max_model_len=max_model_len,
        **kwargs,
    )
    try:
        out = llm.generate([layout.prompt], params(), use_tqdm=False)[0]
        if store is not None:
            _drain_puts(llm)
        completion = out.outputs[0]
        first = {t: lp.logprob for t, lp in completion.logprobs[0].items()}
        return completion.text, first, _counters(llm)
    finally:
        close_llm(llm)


def test_replicas_that_rotate_differently_share_no_entry(tmp_path):
    model = str(build("phi3", tmp_path / "tiny-phi3", models_dir() / "tiny-llama"))
    rng = random.Random("rotation")
    layout = Layout(
        "sys",
        [random_text(rng, rng.randint(20, 40)) for _ in range(4)],
        "what is first",
    )
    with MooncakeFleet(tmp_path / "mooncake", lookup_timeout_s=5.0) as fleet:
        _, _, a = _answer(model, 1024, layout, fleet.spec_text)
        assert a["child_computes"] == 5 and a["store_hits"] == 0
        text_b, first_b, b = _answer(model, 2048, layout, fleet.spec_text)
        # The control: the same rotation as A's reads A's entries.
        _, _, d = _answer(model, 1024, layout, fleet.spec_text)
    text_c, first_c, _ = _answer(model, 2048, layout, None)
    assert d["store_hits"] == 5 and d["child_computes"] == 0, d
    assert b["store_hits"] == 0, (
        f"replica B (long factors) read {b['store_hits']} "
        "entries replica A (short factors) wrote"
    )
    assert b["child_computes"] == 5, b
    assert text_b == text_c
    assert first_b.keys() == first_c.keys()
    assert max(abs(first_b[t] - first_c[t]) for t in first_b) < 1e-3
