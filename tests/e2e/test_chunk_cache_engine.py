"""Chunk cache on the real offline engine (tiny Llama, float32): reuse counters,
eviction under a small pool, aborts, prompts without a separator, token-id
prompts, prompt_logprobs refusal (issue 4, acceptance 2, 4, 5, 6).

Every answer is checked against the HF isolation-mask reference (see
test_chunk_cache_exactness.py for the tolerance)."""

from __future__ import annotations

import random

import pytest

# NOTE: a ValueError in vLLM 0.23, a VLLMClientError (not a ValueError) in 0.32: the
# refusals are vLLM validation errors on both, as vLLM's own request checks are.
from vllm.exceptions import VLLMValidationError

from tests.conftest import models_dir
from tests.e2e.chunk_reference import Layout, Reference, compare, random_text
from tests.e2e.engine import chunk_scheduler, close_llm, make_llm

pytestmark = pytest.mark.e2e

MODEL = str(models_dir() / "tiny-llama")
TOL = 1e-3
MODE = "sink"
# Pool: 0.0006 GiB at 2 KiB per token (4 layers x K+V x 2 heads x 32 x fp32)
# = 314 rows = 19 blocks of 16 rows: about three 80-token chunks.
POOL_GIB = 0.0006


@pytest.fixture(scope="module")
def reference():
    return Reference(MODEL)


@pytest.fixture(scope="module")
def llm():
    # A small paged KV cache (16 blocks of 128 tokens) so that preemption happens,
    llm = make_llm(
        MODEL,
        enable_chunk_cache=True,
        chunk_context=MODE,
        chunk_pool_size_gib=POOL_GIB,
        max_num_seqs=8,
        num_gpu_blocks_override=16,
        max_model_len=1024,
        # Small step budget: children and parents prefill in pieces.
        max_num_batched_tokens=192,
    )
    yield llm
    close_llm(llm)


def snapshot(sched) -> dict:
    """The manager's counters and gauges (it owns every one of them)."""
    import dataclasses

    return dataclasses.asdict(sched.manager.stats())


def params(n=3, **kw):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=n, temperature=0.0, logprobs=5, ignore_eos=True, **kw
    )


def rendered(llm, prompt: str):
    """A prompt as LLM.generate hands it to the engine: rendered, so the
    separator is split. NOTE: LLMEngine.add_request given the raw string skips
    the renderer (vLLM's deprecated path) and serves the prompt unsplit."""
    return llm._preprocess_cmpl([prompt])[0]


def check(reference, layout, out):
    prompt = reference.chunked_prompt(layout)
    assert list(out.prompt_token_ids) == prompt.token_ids
    completion = out.outputs[0]
    ref = reference.next_token_logprobs(prompt, MODE, list(completion.token_ids))
    compare(ref, list(completion.token_ids), completion.logprobs, TOL)
    return prompt


def doc(rng, words):
    return random_text(rng, words)


def test_pool_is_sized_from_the_flag(llm):
    snap = snapshot(chunk_scheduler(llm))
    assert snap["pool_blocks_total"] == 19


def test_reuse_after_another_system_prompt_hits_every_chunk(llm, reference):
    rng = random.Random("reuse")
    a, b = doc(rng, 30), doc(rng, 25)
    sched = chunk_scheduler(llm)
    first = Layout("system one", [a, b], "what is it")
    out = llm.generate([first.prompt], params(), use_tqdm=False)[0]
    prompt = check(reference, first, out)
    assert out.num_cached_tokens == prompt.question_span.start
    before = snapshot(sched)
    second = Layout("another system", [b, a], "and now")
    out = llm.generate([second.prompt], params(), use_tqdm=False)[0]
    prompt = check(reference, second, out)
    after = snapshot(sched)
    # Both chunks hit (in the other order, after another system prompt); only
    # the new system segment was computed by a child.
    assert after["hits"] - before["hits"] == 2
    assert after["misses"] - before["misses"] == 1
    assert after["child_computes"] - before["child_computes"] == 1
    assert after["tokens_reused"] - before["tokens_reused"] == sum(
        s.num_tokens for s in prompt.chunk_spans
    )
    # vLLM's own per-request counter: everything but the question was cached.
    assert out.num_cached_tokens == prompt.question_span.start
    assert (
        len(out.prompt_token_ids) - out.num_cached_tokens
        == prompt.question_span.num_tokens
    )


def test_repeated_prompt_combines_vllm_prefix_cache_and_chunk_cache(llm, reference):
    rng = random.Random("repeat")
    layout = Layout("sys", [doc(rng, 35), doc(rng, 20)], "the same question")
    sched = chunk_scheduler(llm)
    first = llm.generate([layout.prompt], params(), use_tqdm=False)[0]
    prompt = check(reference, layout, first)
    assert prompt.question_span.start > 128
    before = snapshot(sched)
    again = llm.generate([layout.prompt], params(), use_tqdm=False)[0]
    check(reference, layout, again)
    loaded = snapshot(sched)["tokens_loaded"] - before["tokens_loaded"]
    # vLLM's prefix cache (same layout salt, same tokens) served the full
    # 128-token blocks; the chunk cache loaded only the rest before the question.
    assert again.num_cached_tokens >= prompt.question_span.start
    assert loaded == prompt.question_span.start - 128 * (
        prompt.question_span.start // 128
    )


def test_a_new_question_over_the_same_documents_hits_vllm_prefix_cache(llm, reference):
    """Issue 20, finding 7. Before: the layout (the question's length too) keyed
    the first block, so another question over the same system prompt and
    documents shared no block with the first: every document was loaded again."""
    rng = random.Random("follow-up")
    docs = [doc(rng, 35), doc(rng, 20)]
    sched = chunk_scheduler(llm)
    first = Layout("sys", docs, "what does the first say")
    first_prompt = check(
        reference, first, llm.generate([first.prompt], params(), use_tqdm=False)[0]
    )
    start = first_prompt.question_span.start
    assert start > 128
    before = snapshot(sched)
    follow_up = Layout("sys", docs, "and the second one, in a few more words?")
    out = llm.generate([follow_up.prompt], params(), use_tqdm=False)[0]
    prompt = check(reference, follow_up, out)
    assert prompt.question_span.start == start
    assert prompt.question_span.num_tokens != first_prompt.question_span.num_tokens
    loaded = snapshot(sched)["tokens_loaded"] - before["tokens_loaded"]
    # vLLM's prefix cache served the full 128-token blocks of the documents;
    # the chunk cache loaded only the rest before the question.
    assert out.num_cached_tokens >= start
    assert loaded == start - 128 * (start // 128)


def test_cache_salt_isolates_tenants(llm, reference):
    from vllm.inputs import TextPrompt

    rng = random.Random("salt")
    layout = Layout("sys", [doc(rng, 10)], "q salt")
    sched = chunk_scheduler(llm)

    def run(salt):
        before = snapshot(sched)
        out = llm.generate(
            [TextPrompt(prompt=layout.prompt, cache_salt=salt)],
            params(),
            use_tqdm=False,
        )[0]
        check(reference, layout, out)
        after = snapshot(sched)
        return after["hits"] - before["hits"], after["misses"] - before["misses"]

    assert run("tenant-a") == (0, 2)
    assert run("tenant-a") == (2, 0)
    assert run("tenant-b") == (0, 2)  # another tenant never sees tenant a's entries
    # A salt shaped like the old layout encoding is only a salt: its own namespace.
    assert run("vllm-chunk-cache/v1/3/=tenant-a") == (0, 2)


def test_eviction_under_a_small_pool_keeps_answers_exact(llm, reference):
    rng = random.Random("evict")
    # 60-90 tokens each (4-6 pool blocks): about three fit the 19-block pool.
    docs = [doc(rng, rng.randint(12, 18)) for _ in range(10)]
    sched = chunk_scheduler(llm)
    before = snapshot(sched)
    for i in range(10):
        layout = Layout("sys", [docs[i], docs[(i + 3) % 10]], f"question {i}")
        out = llm.generate([layout.prompt], params(2), use_tqdm=False)[0]
        check(reference, layout, out)
    after = snapshot(sched)
    assert after["evictions"] > before["evictions"]
    assert after["refused_requests"] == before["refused_requests"]
    assert after["pinned_entries"] == 0
    assert after["pool_blocks_used"] <= after["pool_blocks_total"]


def test_requests_wait_for_pool_room_instead_of_falling_back(llm, reference):
    rng = random.Random("defer")
    # Each request needs ~11 of the 19 pool blocks for its own two new chunks:
    # submitted together, later ones must wait until earlier ones release pins.
    layouts = [Layout("sys", [doc(rng, 16), doc(rng, 16)], f"q {i}") for i in range(4)]
    sched = chunk_scheduler(llm)
    before = snapshot(sched)
    outs = llm.generate([lay.prompt for lay in layouts], params(2), use_tqdm=False)
    for layout, out in zip(layouts, outs):
        prompt = check(reference, layout, out)
        assert out.num_cached_tokens == prompt.question_span.start
    after = snapshot(sched)
    assert after["deferred_requests"] > before["deferred_requests"]
    assert after["refused_requests"] == before["refused_requests"]
    assert after["pinned_entries"] == 0


def test_abort_and_preemption_leave_nothing_pinned(llm, reference):
    rng = random.Random("abort")
    engine = llm.llm_engine
    sched = chunk_scheduler(llm)
    layouts = [Layout("sys", [doc(rng, 40)], f"q{i}") for i in range(3)]
    for i, layout in enumerate(layouts):
        engine.add_request(f"abort-{i}", rendered(llm, layout.prompt), params(50))
    # Step until every request is running (children done, parents loaded),
    # then abort them mid-generation; one more is aborted while waiting.
    for _ in range(6):
        engine.step()
    assert snapshot(sched)["live_requests"] == 3  # all three are chunked (split)
    waiting = Layout("sys", [doc(rng, 30)], "q")
    engine.add_request("abort-waiting", rendered(llm, waiting.prompt), params(5))
    engine.abort_request(["abort-0", "abort-1", "abort-2", "abort-waiting"])
    while engine.has_unfinished_requests():
        engine.step()
    # Children still in flight run to completion (their rows stay useful).
    for _ in range(5):
        engine.step()
    snap = snapshot(sched)
    assert snap["pinned_entries"] == 0
    assert snap["live_requests"] == 0
    # The engine still answers correctly afterwards.
    layout = Layout("sys", [layouts[0].chunks[0]], "after the aborts")
    out = llm.generate([layout.prompt], params(), use_tqdm=False)[0]
    check(reference, layout, out)


def test_preempted_requests_reload_their_chunks_and_stay_exact(llm, reference):
    rng = random.Random("preempt")
    docs = [doc(rng, rng.randint(8, 12)) for _ in range(3)]
    layouts = [
        Layout("sys", [docs[i % 3], docs[(i + 1) % 3]], f"q {i}") for i in range(8)
    ]
    sched = chunk_scheduler(llm)
    before = snapshot(sched)
    # 8 x ~(120 prompt + 200 generated) tokens need ~24 blocks: the 16-block
    # KV cache forces preemptions; preempted parents reload from the pool.
    outs = llm.generate([lay.prompt for lay in layouts], params(200), use_tqdm=False)
    loaded = snapshot(sched)["tokens_loaded"] - before["tokens_loaded"]
    expected = 0
    for layout, out in zip(layouts, outs):
        expected += check(reference, layout, out).question_span.start
    assert loaded > expected, "no request was preempted and reloaded"
    snap = snapshot(sched)
    assert snap["pinned_entries"] == 0 and snap["live_requests"] == 0


def scale_input_norms(factor: float):
    """A weight update in place, as RL trainers do it: every layer's input
    RMSNorm weight times `factor` (a power of two: undone exactly)."""

    def scale(model) -> None:
        import torch

        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith("input_layernorm.weight"):
                    weight.mul_(factor)

    return scale


def update_weights(llm, reference, factor: float) -> None:
    scale = scale_input_norms(factor)
    llm.collective_rpc(lambda worker: scale(worker.model_runner.model))
    scale(reference.model)


def test_weight_update_and_reset_serve_kv_of_the_new_weights(llm, reference):
    """Update the weights in place, reset the caches (what vLLM's weight-update
    and sleep paths do): the same documents are computed again, and the answer
    is the reference's with the new weights, never the old model's KV."""
    rng = random.Random("weights")
    layout = Layout("sys", [doc(rng, 30), doc(rng, 25)], "after new weights")
    check(reference, layout, llm.generate([layout.prompt], params(), use_tqdm=False)[0])
    sched = chunk_scheduler(llm)
    before = snapshot(sched)
    update_weights(llm, reference, 2.0)
    try:
        assert llm.reset_prefix_cache(reset_connector=True) is True
        out = llm.generate([layout.prompt], params(), use_tqdm=False)[0]
        check(reference, layout, out)
        snap = snapshot(sched)
        assert (snap["hits"] - before["hits"], snap["misses"] - before["misses"]) == (
            0,
            3,
        )
    finally:
        update_weights(llm, reference, 0.5)
        llm.reset_prefix_cache(reset_connector=True)


def test_sleep_empties_the_pool_and_the_answer_after_wake_up_is_exact(llm, reference):
    """VLLM's sleep (level >= 1) discards the KV cache memory, the pool's
    included: it resets the caches, the connector's too, so nothing is marked
    resident after it (the CPU worker keeps its memory, but the index must
    not know that). After wake_up the documents are computed again."""
    rng = random.Random("sleep")
    layout = Layout("sys", [doc(rng, 30), doc(rng, 25)], "after a nap")
    check(reference, layout, llm.generate([layout.prompt], params(), use_tqdm=False)[0])
    sched = chunk_scheduler(llm)
    assert snapshot(sched)["pool_blocks_used"] > 0
    llm.sleep(level=1)
    llm.wake_up()
    assert snapshot(sched)["pool_blocks_used"] == 0
    before = snapshot(sched)
    check(reference, layout, llm.generate([layout.prompt], params(), use_tqdm=False)[0])
    snap = snapshot(sched)
    assert (snap["hits"] - before["hits"], snap["misses"] - before["misses"]) == (0, 3)


def test_a_document_that_cannot_be_computed_fails_its_request_with_the_reason(
    llm, reference
):
    """A document's child that ends without its rows twice (here: aborted by
    the engine while it waits) refuses its parent. The client reads why in the
    output (the error finish's stop_reason: which document, how its child
    ended, that a retry is safe), and the retry is served and exact."""
    from vllm import SamplingParams
    from vllm.v1.core.chunk_cache_manager import CHILD_REQUEST_PREFIX

    rng = random.Random("child fails")
    warm = Layout("sys", [doc(rng, 10)], "warm the system prompt")
    check(reference, warm, llm.generate([warm.prompt], params(), use_tqdm=False)[0])
    layout = Layout("sys", [doc(rng, 20)], "which document failed?")
    num_doc_tokens = reference.chunked_prompt(layout).spans[1].num_tokens
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    sched = chunk_scheduler(llm)
    # The parent is admitted first (its system prompt resident: one child).
    engine.add_request("child-fails", rendered(llm, layout.prompt), params())
    engine.step()
    # NOTE: a plain 900-token prompt then takes each step's whole budget (192)
    # for five steps, so the child and its retry wait where an abort finds them.
    plain = {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(900)]}
    engine.add_request("budget-eater", plain, SamplingParams(max_tokens=1))
    aborted: set[str] = set()
    final = None
    for _ in range(4):
        for out in engine.step():
            if out.request_id == "child-fails" and out.finished:
                final = out
        if final is not None:
            break
        children = [r for r in scheduler.requests if r.startswith(CHILD_REQUEST_PREFIX)]
        # NOTE: to the engine core, as the front end sends a client's abort
        # (the front end's own abort only knows its clients' requests).
        engine.engine_core.abort_requests(children)
        aborted.update(children)
    assert final is not None and len(aborted) == 2
    while engine.has_unfinished_requests():
        engine.step()
    completion = final.outputs[0]
    assert completion.finish_reason == "error" and list(completion.token_ids) == []
    reason = completion.stop_reason
    assert isinstance(reason, str)
    assert f"document 1 of this request ({num_doc_tokens} tokens" in reason
    assert (
        "could not be computed (2 attempts, the last ended FINISHED_ABORTED)" in reason
    )
    assert "retrying the request is safe" in reason
    snap = snapshot(sched)
    assert snap["pinned_entries"] == 0 and snap["live_requests"] == 0
    # Retrying is safe: computed afresh, exact.
    check(reference, layout, llm.generate([layout.prompt], params(), use_tqdm=False)[0])


def test_prompt_segments_offline_hit_the_separator_forms_chunks_and_stay_exact(
    llm, reference
):
    """LLM.generate({"prompt_segments": [...]}): the documents of a separator
    prompt are hits in another order, as strings and as token-id lists."""
    rng = random.Random("offline segments")
    docs = [doc(rng, 12), doc(rng, 9)]
    first = Layout("sys", docs, "first question")
    check(reference, first, llm.generate([first.prompt], params(), use_tqdm=False)[0])
    sched = chunk_scheduler(llm)
    before = snapshot(sched)
    second = Layout("sys", docs[::-1], "second question")
    segments = [second.system, *second.chunks, second.question]
    out = llm.generate([{"prompt_segments": segments}], params(), use_tqdm=False)[0]
    check(reference, second, out)
    prompt = reference.chunked_prompt(second)
    as_ids = [prompt.token_ids[s.start : s.end] for s in prompt.spans]
    out = llm.generate([{"prompt_segments": as_ids}], params(), use_tqdm=False)[0]
    check(reference, second, out)
    snap = snapshot(sched)
    assert snap["child_computes"] == before["child_computes"]
    assert snap["misses"] == before["misses"] and snap["hits"] - before["hits"] == 6


RAG_TEMPLATE = (
    "System: {{ messages[0].content }}\n"
    "{% for d in documents %}Document {{ loop.index }}: {{ d.title }}\n{{ d.text }}\n"
    "{% endfor %}User: {{ messages[-1].content }}\nAssistant:"
)


def test_chat_documents_are_chunks_where_the_template_renders_them(llm, reference):
    """LLM.chat with `documents` and a template that renders them: the prompt's
    tokens are the template's own, each document is a chunk (the template's
    words between documents one too), exact against the isolation reference,
    and a document hits what the structured completions form cached."""
    from vllm.v1.core.chunk_structures import ChunkedPrompt

    rng = random.Random("chat documents")
    docs = [
        {"title": "First", "text": doc(rng, 10)},
        {"title": "Second", "text": "## " + doc(rng, 8) + " ##"},
    ]
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What do they say?"},
    ]
    sched = chunk_scheduler(llm)
    before = snapshot(sched)
    out = llm.chat(
        messages, params(), use_tqdm=False, chat_template=RAG_TEMPLATE, documents=docs
    )[0]
    tok = reference.tokenizer
    plain = tok.apply_chat_template(
        messages, chat_template=RAG_TEMPLATE, documents=docs, tokenize=False
    )
    assert list(out.prompt_token_ids) == tok.encode(plain, add_special_tokens=False)
    pieces = [
        "System: Answer briefly.\nDocument 1:",
        f" First\n{docs[0]['text']}",
        "\nDocument 2:",
        f" Second\n{docs[1]['text']}",
        "\nUser: What do they say?\nAssistant:",
    ]
    assert "".join(pieces) == plain
    lengths = [len(tok.encode(p, add_special_tokens=False)) for p in pieces]
    prompt = ChunkedPrompt.from_lengths(list(out.prompt_token_ids), lengths)
    completion = out.outputs[0]
    ref = reference.next_token_logprobs(prompt, MODE, list(completion.token_ids))
    compare(ref, list(completion.token_ids), completion.logprobs, TOL)
    assert snapshot(sched)["misses"] - before["misses"] == 4
    # The second document, sent as a segment of a completion: a hit.
    before = snapshot(sched)
    llm.generate(
        [{"prompt_segments": ["sys", pieces[3], "q"]}], params(), use_tqdm=False
    )
    assert snapshot(sched)["hits"] - before["hits"] >= 1
    assert (
        snapshot(sched)["child_computes"] - before["child_computes"] <= 1
    )  # "sys" only


def test_chat_content_parts_marked_chunk_are_chunks_offline(llm, reference):
    from vllm.v1.core.chunk_structures import ChunkedPrompt

    template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    )
    rng = random.Random("offline parts")
    docs = [doc(rng, 9), doc(rng, 7)]
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                *({"type": "text", "text": d, "chunk": True} for d in docs),
                {"type": "text", "text": "And so?"},
            ],
        },
    ]
    out = llm.chat(messages, params(), use_tqdm=False, chat_template=template)[0]
    # vLLM joins a message's text parts with a newline for such a template.
    pieces = [
        "system: Be brief.\nuser:",
        f" {docs[0]}",
        "\n",
        docs[1],
        "\nAnd so?\nassistant:",
    ]
    tok = reference.tokenizer
    assert list(out.prompt_token_ids) == tok.encode(
        "".join(pieces), add_special_tokens=False
    )
    lengths = [len(tok.encode(p, add_special_tokens=False)) for p in pieces]
    prompt = ChunkedPrompt.from_lengths(list(out.prompt_token_ids), lengths)
    completion = out.outputs[0]
    ref = reference.next_token_logprobs(prompt, MODE, list(completion.token_ids))
    compare(ref, list(completion.token_ids), completion.logprobs, TOL)


def test_chat_documents_with_a_template_that_ignores_them_are_refused(llm):
    from vllm.exceptions import VLLMValidationError

    template = "System: {{ messages[0].content }}\nUser: {{ messages[-1].content }}"
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    with pytest.raises(VLLMValidationError, match="does not render 'documents'"):
        llm.chat(
            messages,
            params(),
            use_tqdm=False,
            chat_template=template,
            documents=[{"text": "a document"}],
        )


def test_prompt_without_separator_is_plain_vllm(llm, reference):
    import torch

    text = "a plain prompt with no separator at all"
    out = llm.generate([text], params(), use_tqdm=False)[0]
    ids = reference.tokenizer.encode(text)
    assert list(out.prompt_token_ids) == ids
    assert out.num_cached_tokens == 0 or out.num_cached_tokens % 128 == 0
    with torch.no_grad():
        logits = reference.model(
            input_ids=torch.tensor([ids + list(out.outputs[0].token_ids)])
        ).logits[0]
    ref = torch.log_softmax(logits.double(), -1)[len(ids) - 1 :]
    compare(ref, list(out.outputs[0].token_ids), out.outputs[0].logprobs, TOL)


def test_token_id_prompt_is_split_on_the_separator_ids(llm, reference):
    from vllm.inputs import TokensPrompt

    rng = random.Random("tokens")
    layout = Layout("sys", [doc(rng, 20), doc(rng, 15)], "q tokens")
    prompt = reference.chunked_prompt(layout)
    sep = reference.tokenizer.encode("##", add_special_tokens=False)
    ids: list[int] = []
    for i in range(prompt.num_segments):
        if i:
            ids += sep
        ids += prompt.segment_tokens(i)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params(), use_tqdm=False)[
        0
    ]
    assert list(out.prompt_token_ids) == prompt.token_ids
    assert out.num_cached_tokens == prompt.question_span.start
    completion = out.outputs[0]
    ref = reference.next_token_logprobs(prompt, MODE, list(completion.token_ids))
    compare(ref, list(completion.token_ids), completion.logprobs, TOL)


@pytest.mark.parametrize(
    "prompt,message",
    [
        ("sys ## ## question", "segment 1 is empty"),
        ("##", "segment 1 is empty"),
        ("sys ## doc ## ", "segment 2 is empty"),
    ],
)
def test_bad_chunked_prompts_are_refused_with_a_message(llm, prompt, message):
    with pytest.raises(VLLMValidationError, match=message):
        llm.generate([prompt], params(), use_tqdm=False)


def test_prompt_logprobs_are_refused_for_chunked_prompts(llm):
    with pytest.raises(VLLMValidationError, match="prompt_logprobs is not supported"):
        llm.generate(["sys ## doc ## q"], params(prompt_logprobs=1), use_tqdm=False)
    # A plain prompt may still ask for them.
    out = llm.generate(["plain prompt"], params(prompt_logprobs=1), use_tqdm=False)[0]
    assert out.prompt_logprobs is not None


def test_segments_larger_than_the_pool_are_refused_offline_too(llm):
    rng = random.Random("oversize")
    layout = Layout("sys", [doc(rng, 60) for _ in range(3)], "q")  # > 19 blocks of rows
    before = snapshot(chunk_scheduler(llm))
    with pytest.raises(VLLMValidationError, match="chunk pool") as e:
        llm.generate([layout.prompt], params(), use_tqdm=False)
    assert "--chunk-pool" in str(e.value)
    assert snapshot(chunk_scheduler(llm))["child_computes"] == before["child_computes"]


def test_a_prompt_may_not_bring_its_own_layout(llm):
    with pytest.raises(VLLMValidationError, match="may not carry one"):
        llm.generate(
            [{"prompt_token_ids": [5, 6, 7, 8], "chunk_layout": [1, 2, 1]}],
            params(),
            use_tqdm=False,
        )
