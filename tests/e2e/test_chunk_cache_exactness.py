"""Exactness of the chunk cache on the real engine (issue 4, acceptance 1).

On the tiny random Llama and on SmolLM2-135M-Instruct, for random layouts (1-8 chunks, lengths not multiples of the KV block size,
shuffled order, cold and warm cache) and every `chunk_context` mode, vLLM with
`enable_chunk_cache=True` must give the greedy tokens and top-5 logprobs of an HF
transformers forward over the extended sequence with explicit position ids and
the 4D chunk-isolation mask.

Tolerance: |logprob difference| <= 1e-3 in float32. Both sides run float32;
they differ only in kernel accumulation order (vLLM's CPU paged attention and
oneDNN GEMMs vs torch eager) and in the RoPE re-rotation of cached keys (fp32
rotation by the position delta instead of rotation at the real position, ~1e-7
relative). The observed differences are ~1e-5; 1e-3 is two orders of magnitude
above that and far below what any semantic error produces (a wrong mask, a
missing rotation or a wrong sink shifts logprobs by >= 1e-1 on this model).
A greedy token may differ from the reference argmax only where the reference
itself has a near-tie within the tolerance.

Boundary recompute (`chunk_recompute_tokens` = K > 0, issue 11): the first K tokens
of every chunk are computed inside the request; the reference is the extended
sequence with those tokens real (seeing every real token before them) and private
isolated copies of them for the rest of their chunk. Every mode, cold, warm and
shuffled, on the tiny Llama; K = 12 (the measured setting) on SmolLM2 in `sink`.
"""

from __future__ import annotations

import random

import pytest
import vllm
from vllm.config import ChunkCacheConfig
from vllm.v1.core.chunk_prefill_plan import PrefillPlan

from tests.conftest import models_dir
from tests.e2e.chunk_reference import (
    ExactnessTally,
    Layout,
    Reference,
    compare,
    random_text,
)
from tests.e2e.engine import CPU_MLA_ARGS, close_llm, make_llm

pytestmark = pytest.mark.e2e

TINY = str(models_dir() / "tiny-llama")
SMOL = str(models_dir() / "SmolLM2-135M-Instruct")
# MLA (issue 22): the tiny DeepSeek-V3 on vLLM's CPU_MLA backend, which vLLM 0.23 lacks
# (test_mla_engine.py checks that 0.23 refuses it). Asked for by name (CPU_MLA_ARGS): on a
# CPU with AMX vLLM 0.32 would pick AMX_MLA instead (issue 59, tests/e2e/engine.py).
DEEPSEEK = str(models_dir() / "tiny-deepseek")
CPU_MLA = pytest.mark.skipif(
    vllm.__version__.startswith("0.23"),
    reason="vLLM 0.23 has no MLA attention on the CPU",
)
BLOCK_SIZE = 128
TOL = 1e-3
NUM_GEN = 4
# (model, chunk_context, vLLM prefix caching, max words per document, boundary
# recompute K): every mode on both models, prefix caching off once; boundary
# recompute in every mode (prefix caching off once: exact cached-token counts).
# The default tier covers each invariant once (every mode on the tiny Llama, the real
# model, prefix caching off with exact counts, boundary recompute); the `slow` tier
# (`./fork test -m slow`) sweeps the rest.
SLOW = pytest.mark.slow
# A sixth element caps the rows loaded per step (--max-chunk-load-tokens, issue 20
# finding 3): 40 rows makes every load of the `system` run wait for its own step
# and go through the load buffers in pieces.
# A seventh, "hook", captures in the attention hook (patch 0004) on every layer, as on a
# quantized or AMX-packed cache, which the developers' CI machines lack (issue 21; AMX:
# issue 59, docs/design/capture.md; elsewhere captures run after the forward from the
# paged blocks wherever the start-up self-check reads them back).
CONFIGS = [
    (TINY, "sink", True, 160, 0),
    (TINY, "none", True, 160, 0),
    (TINY, "sink", True, 160, 0, None, "hook"),
    (TINY, "system", True, 160, 0, 40),
    pytest.param((TINY, "sink", False, 160, 0), marks=SLOW),
    (SMOL, "sink", True, 60, 0),
    pytest.param((SMOL, "none", True, 60, 0), marks=SLOW),
    pytest.param((SMOL, "system", True, 60, 0), marks=SLOW),
    (TINY, "sink", False, 160, 5),
    pytest.param((TINY, "none", True, 160, 5), marks=SLOW),
    pytest.param((TINY, "system", True, 160, 5), marks=SLOW),
    pytest.param((SMOL, "sink", True, 60, 12), marks=SLOW),
    # vLLM turns prefix caching off for MLA on the CPU: exact cached-token counts.
    pytest.param((DEEPSEEK, "sink", False, 160, 0), marks=CPU_MLA),
    pytest.param((DEEPSEEK, "system", False, 160, 0), marks=CPU_MLA),
    pytest.param((DEEPSEEK, "sink", False, 160, 5), marks=CPU_MLA),
    pytest.param((DEEPSEEK, "none", False, 160, 0), marks=[CPU_MLA, SLOW]),
]


def _config_id(c) -> str:
    return (
        f"{c[0].rsplit('/', 1)[-1]}-{c[1]}-prefix{int(c[2])}"
        + (f"-recompute{c[4]}" if c[4] else "")
        + (f"-cap{c[5]}" if len(c) > 5 and c[5] else "")
        + ("-hook" if len(c) > 6 else "")
    )


_REFERENCES: dict[str, Reference] = {}


@pytest.fixture(scope="module", params=CONFIGS, ids=_config_id)
def engine(request):
    model, mode, prefix_caching, max_words, recompute, *rest = request.param
    cap = rest[0] if rest and rest[0] else ChunkCacheConfig.max_chunk_load_tokens
    with pytest.MonkeyPatch.context() as patch:
        if len(rest) > 1:
            # The in-process engine's worker takes its capture path from this check.
            from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import (
                capture_path,
            )

            patch.setattr(
                capture_path,
                "self_check",
                lambda *args: "forced by the test (the hook path)",
            )
        llm = make_llm(
            model,
            enable_chunk_cache=True,
            chunk_context=mode,
            enable_prefix_caching=prefix_caching,
            chunk_recompute_tokens=recompute,
            max_chunk_load_tokens=cap,
            **(CPU_MLA_ARGS if model == DEEPSEEK else {}),
        )
    if len(rest) > 1:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        capture = get_kv_transfer_group()._worker._capture
        assert capture.in_attention and not capture.after_forward, capture.summary()
    if model not in _REFERENCES:
        _REFERENCES.clear()
        _REFERENCES[model] = Reference(model)
    yield mode, llm, _REFERENCES[model], max_words, recompute, prefix_caching
    close_llm(llm)


def _docs(
    rng: random.Random, reference: Reference, n: int, max_words: int
) -> list[str]:
    docs = []
    while len(docs) < n:
        text = random_text(rng, rng.randint(5, max_words))
        length = len(reference.tokenizer.encode(text, add_special_tokens=False))
        if length % BLOCK_SIZE != 0:
            docs.append(text)
    return docs


def _layouts(rng: random.Random, docs: list[str], n: int) -> list[Layout]:
    systems = ["you are a careful assistant", "answer briefly", "sys"]
    out = []
    for _ in range(n):
        k = rng.randint(1, min(8, len(docs)))
        chunks = rng.sample(docs, k)
        rng.shuffle(chunks)
        out.append(
            Layout(rng.choice(systems), chunks, random_text(rng, rng.randint(1, 12)))
        )
    return out


def test_random_layouts_match_the_isolation_mask_reference(engine):
    from vllm import SamplingParams

    mode, llm, reference, max_words, recompute, prefix_caching = engine
    rng = random.Random(f"exactness-{mode}-{recompute}")
    docs = _docs(rng, reference, 12, max_words)
    params = SamplingParams(
        max_tokens=NUM_GEN, temperature=0.0, logprobs=5, ignore_eos=True
    )
    tally = ExactnessTally()
    # Batches of concurrent requests: the first batch is all cold, later ones
    # mix chunks seen before (warm) with new ones (cold), in shuffled order.
    for step in range(3):
        # cold; then mixed; then only chunks seen before (warm), reordered.
        pool = docs[:6] if step == 0 else docs if step == 1 else sorted(tally.seen)
        batch = _layouts(rng, pool, 3 if step < 2 else 2)
        outputs = llm.generate(
            [layout.prompt for layout in batch], params, use_tqdm=False
        )
        for layout, out in zip(batch, outputs):
            prompt = reference.chunked_prompt(layout)
            assert list(out.prompt_token_ids) == prompt.token_ids
            completion = out.outputs[0]
            ref = reference.next_token_logprobs(
                prompt, mode, list(completion.token_ids), recompute_tokens=recompute
            )
            result = compare(ref, list(completion.token_ids), completion.logprobs, TOL)
            # Only the question (and with K > 0 the chunks' heads) was computed by
            # the parent; vLLM's prefix cache may hold heads of an earlier request.
            loaded = PrefillPlan.for_prompt(prompt, recompute).num_loaded
            if prefix_caching:
                assert loaded <= out.num_cached_tokens <= prompt.question_span.start
            else:
                assert out.num_cached_tokens == loaded
            # Negative control: the same tokens under plain causal attention
            # (no isolation) are far outside the tolerance, so the comparison
            # above does discriminate.
            causal = reference.causal_logprobs(prompt, list(completion.token_ids))
            step0 = completion.logprobs[0]
            control = max(
                abs(lp.logprob - float(causal[0][t])) for t, lp in step0.items()
            )
            tally.add(layout, result, control)
        tally.sent(batch)
    print(f"mode={mode}: {tally}")
    tally.check(layouts=8, min_cold=1, min_warm=1, tol=TOL)
