"""MLA (DeepSeek-V3-style) under the chunk cache's semantics, on the tiny DeepSeek
(issue 22).

No engine here (see test_chunk_cache_exactness.py for the engine on vLLM 0.32's
CPU_MLA): HF transformers' DeepSeek-V3 caches MLA's latent row, and
mla_reference.LatentCacheEmulation runs the chunk cache's MLA data path on that cache (a
child's latent rows at stored positions, `kv_c` copied and `k_pe` rotated by the delta
with the fork's `reposition_latent_rows` and vLLM's own rope). For random layouts in
every context mode, cold and then warm in another order, it must equal the
isolation-mask reference, within the float32 tolerance of the engine tests (1e-3;
observed ~1e-6, two re-rotations' rounding), while three controls are far from it: plain
causal attention, a load that does not rotate `k_pe`, and a load that rotates it with
the rope's own cos/sin (applying DeepSeek's mscale a second time).
"""

from __future__ import annotations

import random

import pytest
import torch
from vllm.v1.worker.position_remapper import RopeRotation

from tests.conftest import models_dir
from tests.e2e.chunk_reference import Layout, Reference, private_context, random_text
from tests.e2e.mla_reference import LatentCacheEmulation, vllm_rope_for

MODEL = str(models_dir() / "tiny-deepseek")
TOL = 1e-3
GENERATED = [37, 101, 250]


@pytest.fixture(scope="module")
def reference():
    return Reference(MODEL)


@pytest.fixture(scope="module")
def rope(reference):
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # vLLM's ropes are CustomOps
        rope = vllm_rope_for(reference.model.config)
    assert type(rope).__name__ == "DeepseekScalingRotaryEmbedding"
    assert not rope.is_neox_style
    # The tiny model's mscale != mscale_all_dim: its cos/sin carry a magnitude != 1.
    assert abs(rope.mscale - 1.037) < 1e-3
    return rope


@pytest.fixture(scope="module")
def rotation(rope):
    return RopeRotation(rope)


def _layouts(rng: random.Random, n: int) -> list[Layout]:
    return [
        Layout(
            system=random_text(rng, rng.randint(3, 8)),
            chunks=[
                random_text(rng, rng.randint(4, 20)) for _ in range(rng.randint(2, 4))
            ],
            question=random_text(rng, rng.randint(3, 6)),
        )
        for _ in range(n)
    ]


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("mode", ["none", "sink", "system"])
def test_latent_rows_moved_by_k_pe_rotation_equal_the_isolation_reference(
    reference, rotation, mode
):
    emulation = LatentCacheEmulation(reference.model, rotation)
    context_of = private_context(reference, mode)
    rng = random.Random(22)
    worst = 0.0
    for layout in _layouts(rng, 2):
        # Cold, then warm with the chunks in another order (other deltas, same entries).
        warm = Layout(layout.system, list(reversed(layout.chunks)), layout.question)
        for step, current in enumerate((layout, warm)):
            before = emulation.computed_chunks
            prompt = reference.chunked_prompt(current)
            got = emulation.logprobs(prompt, context_of, GENERATED)
            want = reference.next_token_logprobs(prompt, mode, GENERATED)
            worst = max(worst, _distance(got, want))
            assert emulation.computed_chunks - before == (
                len(current.chunks) if step == 0 else 0
            )
    assert worst < TOL / 10, f"MLA load path vs isolation reference: {worst:.2e}"


def test_the_controls_are_far_from_the_reference(reference, rope, rotation):
    emulation = LatentCacheEmulation(reference.model, rotation)
    context_of = private_context(reference, "sink")
    prompt = reference.chunked_prompt(_layouts(random.Random(7), 1)[0])
    want = reference.next_token_logprobs(prompt, "sink", GENERATED)

    assert _distance(emulation.logprobs(prompt, context_of, GENERATED), want) < TOL / 10
    causal = reference.causal_logprobs(prompt, GENERATED)
    not_rotated = emulation.logprobs(
        prompt, context_of, GENERATED, move=lambda k_pe, d: k_pe
    )

    def with_the_ropes_own_cos_sin(k_pe, deltas):
        # What a load built on the rope's cos/sin cache would do: mscale applied again.
        _, moved = rope.forward_native(
            deltas, torch.zeros_like(k_pe)[:, None], k_pe[:, None].clone()
        )
        return moved[:, 0]

    twice = emulation.logprobs(
        prompt, context_of, GENERATED, move=with_the_ropes_own_cos_sin
    )
    for name, control in (
        ("causal", causal),
        ("k_pe not rotated", not_rotated),
        ("mscale applied twice", twice),
    ):
        assert _distance(control, want) > 10 * TOL, name
