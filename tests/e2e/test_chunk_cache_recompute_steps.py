"""Boundary recompute in one engine step (issue 33): every recomputed head and the
question of a request whose documents are all cached are computed in one forward,
as query runs over the request's block table (docs/design/boundary-recompute.md).

One engine (tiny Llama, float32, `sink`, K = 5, vLLM prefix caching off so the
cached-token counts are exact, a 64-token step budget). Every answer is checked
against the extended-sequence reference (an HF forward over
`build_isolated_sequence(..., recompute_tokens=K)`, the oracle of
test_chunk_cache_exactness.py) with the same tolerance, and the engine steps to
the first token are counted with `LLMEngine.step()`:

* several heads in one step (and the same request on the multi-step path, the
  connector switched to one head per step, takes N + 1 steps: what changed);
* a chunk shorter than K (computed whole, inside the same run as the head after it);
* a head split by the step budget (14 heads of 5 do not fit 64 tokens: the first
  step ends inside the 13th head, the second step finishes it);
* a preemption in the middle (after that first step, vLLM's cache reset preempts
  the running request; it restarts from position 0 and stays exact).
"""

from __future__ import annotations

import random

import pytest
from vllm.v1.core.chunk_prefill_plan import PrefillPlan

from tests.conftest import models_dir
from tests.e2e.chunk_reference import Layout, Reference, compare, random_text
from tests.e2e.engine import chunk_scheduler, close_llm, make_llm

pytestmark = pytest.mark.e2e

MODEL = str(models_dir() / "tiny-llama")
MODE = "sink"
K = 5
BUDGET = 64
TOL = 1e-3


@pytest.fixture(scope="module")
def reference():
    return Reference(MODEL)


@pytest.fixture(scope="module")
def llm():
    # Prefix caching off: exact cached-token counts; a small step budget.
    engine = make_llm(
        MODEL,
        enable_chunk_cache=True,
        chunk_context=MODE,
        chunk_recompute_tokens=K,
        enable_prefix_caching=False,
        max_num_batched_tokens=BUDGET,
        max_model_len=2048,
    )
    yield engine
    close_llm(engine)


def _params(n=3):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, logprobs=5, ignore_eos=True)


def _docs(rng, reference, n, lo=20, hi=40):
    """N documents longer than K tokens."""
    docs = []
    while len(docs) < n:
        text = random_text(rng, rng.randint(lo // 4, hi // 4))
        if len(reference.tokenizer.encode(text, add_special_tokens=False)) > K:
            docs.append(text)
    return docs


def _warm(llm, system, docs):
    """Compute and cache the system segment and every document (children)."""
    llm.generate([Layout(system, docs, "ok").prompt], _params(1), use_tqdm=False)


def _run(llm, layout, rid, preempt_after=None):
    """Serve one request step by step: (output, steps to its first token)."""
    engine = llm.llm_engine
    engine.add_request(rid, llm._preprocess_cmpl([layout.prompt])[0], _params())
    steps, first, final = 0, None, None
    while final is None:
        outs = engine.step()
        steps += 1
        if steps == preempt_after:
            # The engine's id of the request: ours with a suffix.
            (request,) = [
                r
                for key, r in engine.engine_core.engine_core.scheduler.requests.items()
                if key.rsplit("-", 1)[0] == rid
            ]
            assert 0 < request.num_computed_tokens < request.num_prompt_tokens
            engine.reset_prefix_cache(reset_running_requests=True)
            assert (request.num_preemptions, request.num_computed_tokens) == (1, 0)
        for out in outs:
            if out.request_id != rid:
                continue
            if first is None and out.outputs[0].token_ids:
                first = steps
            if out.finished:
                final = out
    return final, first


def _check(reference, layout, out, resumed=False):
    prompt = reference.chunked_prompt(layout)
    assert list(out.prompt_token_ids) == prompt.token_ids
    completion = out.outputs[0]
    ref = reference.next_token_logprobs(
        prompt, MODE, list(completion.token_ids), recompute_tokens=K
    )
    compare(ref, list(completion.token_ids), completion.logprobs, TOL)
    loaded = PrefillPlan.for_prompt(prompt, K).num_loaded
    if resumed:
        # vLLM 0.32 counts a preempted request's first prefill only.
        assert 0 < out.num_cached_tokens <= loaded
    else:
        assert out.num_cached_tokens == loaded
    return prompt


def test_every_head_and_the_question_in_one_step(llm, reference):
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.recompute_step import (  # noqa: E501
        RecomputeSteps,
    )

    rng = random.Random("one-step")
    docs = _docs(rng, reference, 4)
    _warm(llm, "answer briefly", docs)
    adapter = chunk_scheduler(llm)
    assert adapter._steps.one_step, adapter._steps.reason
    layout = Layout("answer briefly", rng.sample(docs, 4), "which one?")
    out, steps = _run(llm, layout, "one-step")
    _check(reference, layout, out)
    assert steps == 1
    # The same prompt on the multi-step path: one step per head, then the question.
    one_step = adapter._steps
    adapter._steps = RecomputeSteps(False, "switched off by the test")
    try:
        out, steps = _run(llm, layout, "multi-step")
    finally:
        adapter._steps = one_step
    _check(reference, layout, out)
    assert steps == 4 + 1


def test_a_chunk_shorter_than_k_is_computed_whole_in_the_same_step(llm, reference):
    rng = random.Random("short")
    docs = _docs(rng, reference, 3)
    short = "ab cd"
    assert len(reference.tokenizer.encode(short, add_special_tokens=False)) < K
    _warm(llm, "sys", docs + [short])
    layout = Layout("sys", [docs[0], short, docs[1], docs[2]], "and?")
    out, steps = _run(llm, layout, "short")
    _check(reference, layout, out)
    assert steps == 1


def _budget_layout(rng, reference, llm):
    docs = _docs(rng, reference, 14)
    _warm(llm, "sys", docs)
    layout = Layout("sys", docs, "last one?")
    # 14 heads of K = 5 tokens and the question: more than one step's budget.
    assert 14 * K < BUDGET + 2 * K
    return layout


def test_a_head_split_by_the_step_budget_is_finished_in_the_next_step(llm, reference):
    layout = _budget_layout(random.Random("budget"), reference, llm)
    out, steps = _run(llm, layout, "budget")
    _check(reference, layout, out)
    assert steps == 2


def test_a_request_preempted_in_the_middle_restarts_exact(llm, reference):
    layout = _budget_layout(random.Random("preempt"), reference, llm)
    out, steps = _run(llm, layout, "preempt", preempt_after=1)
    _check(reference, layout, out, resumed=True)
    # Preempted after its first step, it starts over: two steps again.
    assert steps == 1 + 2
    assert chunk_scheduler(llm).manager.stats().pinned_entries == 0
