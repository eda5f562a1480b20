"""Sparse MLA (DeepSeek-V3.2's DSA indexer) under the chunk cache's semantics, on the
tiny DeepSeek-V3.2 (issue 32). No engine: no CPU backend of vLLM runs sparse attention.

* The pure-torch forward (sparse_reference.SparseDeepseek, vLLM's layouts and rope
  objects) equals HF transformers' DeepseekV32: logits, and every layer's top-k
  selection against HF's own indexer output (a forward hook), causal and under the 4D
  isolation mask.
* The selection matters on this model: each question token keeps 6 of dozens of visible
  tokens, and attending to all of them instead is far from the reference.
* The chunk cache's sparse data path (entries of latent rows and indexer keys computed
  in isolation, `kv_c` copied, `k_pe` and the indexer key's rope slice rotated by the
  delta with the fork's own functions) selects the same tokens, in every layer and for
  every question and generated token, and gives the same log-probabilities as the
  isolation-mask forward, for random layouts in every context mode, cold and then warm
  in other orders. Controls: indexer keys not rotated, rotated in the MLA rope's
  pairing, or with the rope's own cos/sin (mscale applied twice) select other tokens.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from vllm.v1.worker.position_remapper import RopeRotation

from tests.conftest import models_dir
from tests.e2e.chunk_reference import Layout, Reference, private_context, random_text
from tests.e2e.sparse_reference import (
    LayerRows,
    SparseCacheEmulation,
    SparseDeepseek,
    fp8_ue8m0_roundtrip,
    isolation_reference,
    vllm_ropes,
)

MODEL = models_dir() / "tiny-deepseek-v32"
TOL = 1e-3
GENERATED = [37, 101, 250]
MODES = ["none", "sink", "system"]


@pytest.fixture(scope="module")
def reference():
    return Reference(str(MODEL))


@pytest.fixture(scope="module")
def ropes():
    from vllm.config import VllmConfig, set_current_vllm_config

    config = json.loads((MODEL / "config.json").read_text())
    with set_current_vllm_config(VllmConfig()):  # vLLM's ropes are CustomOps
        mla, indexer = vllm_ropes(config)
    assert (
        type(mla).__name__ == type(indexer).__name__ == "DeepseekScalingRotaryEmbedding"
    )
    # MLA's k_pe: GPT-J interleaved; the indexer key's slice: neox (no
    # indexer_rope_interleave).
    assert not mla.is_neox_style and indexer.is_neox_style
    assert abs(mla.mscale - 1.037) < 1e-3 and mla.mscale == indexer.mscale
    return mla, indexer


@pytest.fixture(scope="module")
def model(ropes):
    return SparseDeepseek(MODEL, *ropes)


@pytest.fixture(scope="module")
def emulation(model, ropes):
    mla, indexer = ropes
    return SparseCacheEmulation(model, RopeRotation(mla), RopeRotation(indexer))


def _layouts(rng: random.Random, n: int) -> list[Layout]:
    return [
        Layout(
            system=random_text(rng, rng.randint(2, 4)),
            chunks=[random_text(rng, rng.randint(2, 6)) for _ in range(3)],
            question=random_text(rng, rng.randint(2, 4)),
        )
        for _ in range(n)
    ]


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _differing(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(int((x != y).sum()) for x, y in zip(a, b))


def _hf_selections(reference: Reference, run) -> list[torch.Tensor]:
    """Run `run()` and return what each HF layer's DeepseekV32Indexer returned ([1, S,
    k])."""
    caught: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(
            lambda module, args, out: caught.append(out[0].long())
        )
        for layer in reference.model.model.layers
    ]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return caught


def test_pure_torch_forward_equals_hf_deepseek_v32_causal(reference, model):
    ids = reference.tokenizer.encode(random_text(random.Random(3), 12))
    assert len(ids) > 3 * model.topk
    hf_logits = []
    caught = _hf_selections(
        reference,
        lambda: hf_logits.append(
            reference.model(input_ids=torch.tensor([ids])).logits[0].detach()
        ),
    )
    ours = model.forward(ids, list(range(len(ids))))
    assert _distance(ours.logits, hf_logits[0]) < TOL / 10
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    for layer, (sel, hf) in enumerate(zip(ours.selected, caught, strict=True)):
        hf_sel = torch.zeros_like(sel).scatter(-1, hf, True) & causal
        assert torch.equal(sel, hf_sel), f"layer {layer}"


@pytest.mark.parametrize("mode", MODES)
def test_pure_torch_forward_equals_hf_deepseek_v32_under_the_isolation_mask(
    reference, model, mode
):
    from tests.chunk_isolation_mask import build_isolated_sequence

    prompt = reference.chunked_prompt(_layouts(random.Random(5), 1)[0])
    sink = reference.tokenizer.bos_token_id
    want = []
    caught = _hf_selections(
        reference,
        lambda: want.append(reference.next_token_logprobs(prompt, mode, GENERATED)),
    )
    ours = isolation_reference(model, prompt, mode, GENERATED, sink)
    assert _distance(ours.logprobs, want[0]) < TOL / 10
    seq = build_isolated_sequence(
        prompt, mode, extra_token_ids=GENERATED, sink_token_id=sink
    )
    full = model.forward(seq.token_ids, seq.position_ids, allowed=seq.allowed[0, 0])
    for layer, (sel, hf) in enumerate(zip(full.selected, caught, strict=True)):
        hf_sel = torch.zeros_like(sel).scatter(-1, hf, True) & seq.allowed[0, 0]
        assert torch.equal(sel, hf_sel), f"layer {layer}"


def test_the_selection_matters_on_the_tiny_model(reference, model):
    prompt = reference.chunked_prompt(_layouts(random.Random(9), 1)[0])
    sink = reference.tokenizer.bos_token_id
    sparse = isolation_reference(model, prompt, "sink", GENERATED, sink)
    question = prompt.spans[-1].start
    for sel in sparse.selected:
        # Every question token keeps exactly index_topk of the many tokens it sees.
        assert (sel.sum(-1) == model.topk).all()
        assert question > 4 * model.topk
    topk, model.topk = model.topk, 10**6
    try:
        dense = isolation_reference(model, prompt, "sink", GENERATED, sink)
    finally:
        model.topk = topk
    assert _distance(dense.logprobs, sparse.logprobs) > 10 * TOL


@pytest.mark.parametrize("mode", MODES)
def test_loaded_entries_select_and_attend_as_in_isolation(
    reference, model, emulation, mode
):
    context_of = private_context(reference, mode)
    sink = reference.tokenizer.bos_token_id
    rng = random.Random(32)
    worst, selections = 0.0, 0
    for layout in _layouts(rng, 2):
        shuffled = list(layout.chunks)
        rng.shuffle(shuffled)
        # Cold, then warm in reversed and shuffled orders (other deltas, the same
        # entries).
        orders = (layout.chunks, list(reversed(layout.chunks)), shuffled)
        for step, chunks in enumerate(orders):
            current = Layout(layout.system, chunks, layout.question)
            before = emulation.computed_chunks
            prompt = reference.chunked_prompt(current)
            got = emulation.run(prompt, context_of, GENERATED)
            want = isolation_reference(model, prompt, mode, GENERATED, sink)
            assert emulation.computed_chunks - before == (
                len(chunks) if step == 0 else 0
            )
            for layer, (a, b) in enumerate(
                zip(got.selected, want.selected, strict=True)
            ):
                assert torch.equal(a, b), f"layer {layer}: the top-k differs"
                selections += int(b.sum())
            worst = max(worst, _distance(got.logprobs, want.logprobs))
    assert selections > 0
    assert worst < TOL / 10, f"sparse load path vs isolation reference: {worst:.2e}"


def test_indexer_key_controls_select_other_tokens(reference, model, emulation, ropes):
    mla_rope, indexer_rope = ropes
    context_of = private_context(reference, "sink")
    prompt = reference.chunked_prompt(_layouts(random.Random(11), 1)[0])
    want = isolation_reference(
        model, prompt, "sink", GENERATED, reference.tokenizer.bos_token_id
    )
    exact = emulation.run(prompt, context_of, GENERATED)
    assert _differing(exact.selected, want.selected) == 0

    def with_index_k(index_k):
        def move(rows: LayerRows, deltas: torch.Tensor) -> LayerRows:
            moved = emulation.move(rows, deltas)
            return LayerRows(moved.kv_c, moved.k_pe, index_k(rows.index_k, deltas))

        return move

    def own_cos_sin(keys, deltas):
        # A load built on the rope's cos/sin cache: the mscale applied a second time.
        _, rot = indexer_rope.forward_native(
            deltas, torch.zeros_like(keys[:, None, :64]), keys[:, None, :64].clone()
        )
        return torch.cat((rot[:, 0], keys[:, 64:]), -1)

    gptj = RopeRotation(indexer_rope).with_pairing(False)
    controls = {
        "indexer keys not rotated": lambda keys, deltas: keys,
        "rotated in MLA's GPT-J pairing": lambda keys, deltas: torch.cat(
            (gptj.rotate(keys[:, None, :64], deltas)[:, 0], keys[:, 64:]), -1
        ),
        "mscale applied twice": own_cos_sin,
    }
    for name, index_k in controls.items():
        got = emulation.run(prompt, context_of, GENERATED, move=with_index_k(index_k))
        assert _differing(got.selected, want.selected) > 0, name

    # And the latent row still matters on its own: k_pe not rotated, indexer keys right.
    def no_k_pe(rows, deltas):
        moved = emulation.move(rows, deltas)
        return LayerRows(moved.kv_c, rows.k_pe, moved.index_k)

    got = emulation.run(prompt, context_of, GENERATED, move=no_k_pe)
    assert _distance(got.logprobs, want.logprobs) > 10 * TOL
    assert mla_rope.is_neox_style is False


def test_a_quantized_indexer_is_not_translation_invariant(reference, model):
    """Why quantized indexer caches stay refused (docs/design/sparse.md): with vLLM's
    CUDA fp8 indexer arithmetic (keys and queries quantized after the rope, one ue8m0
    scale per 128 values) the isolation forward itself changes when every position moves
    by 5: the rounding depends on the absolute angle, so top-k choices flip and the
    distance argument (hence what a chunk computed at 0.. means at its real positions)
    fails; unquantized, the same shift changes nothing but float rounding. Observed on
    this model: ~8% of the selected (query, token) pairs differ, log-probabilities by 3
    to 5."""
    from tests.chunk_isolation_mask import build_isolated_sequence

    prompt = reference.chunked_prompt(_layouts(random.Random(8), 1)[0])
    seq = build_isolated_sequence(
        prompt,
        "sink",
        extra_token_ids=GENERATED,
        sink_token_id=reference.tokenizer.bos_token_id,
    )
    rows = len(GENERATED) + 1

    def shifted(quant):
        model.index_quant = quant
        try:
            a, b = (
                model.forward(
                    seq.token_ids, seq.position_ids + shift, allowed=seq.allowed[0, 0]
                )
                for shift in (0, 5)
            )
        finally:
            model.index_quant = None
        logprobs = [
            torch.log_softmax(out.logits[-rows:].double(), -1) for out in (a, b)
        ]
        return _differing(a.selected, b.selected), _distance(*logprobs)

    assert shifted(None)[0] == 0 and shifted(None)[1] < TOL / 10
    flips, distance = shifted(fp8_ue8m0_roundtrip)
    assert flips > 0 and distance > 10 * TOL, (flips, distance)
