# SPDX-License-Identifier: Apache-2.0
"""MLA latent rows `[kv_c | k_pe]`: a load copies kv_c and rotates k_pe alone.

Truth is vLLM's own DeepseekScalingRotaryEmbedding, built as vLLM's DeepseekV2/V3
attention builds it (`get_rope(qk_rope_head_dim, ..., is_neox_style=False)`, YaRN
renamed deepseek_yarn) with the tiny DeepSeek's rope parameters (mscale !=
mscale_all_dim, so the cos/sin carry a magnitude of ~1.037 that a load must not apply a
second time). Tolerance as test_position_remapper.py: atol 2e-3 on O(1) entries at
positions < 3200.
"""

import pytest
import torch
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.v1.worker.mla_latent import LatentRowLayout, reposition_latent_rows
from vllm.v1.worker.position_remapper import RopeRotation

# DeepSeek-V3's widths are 512 + 64 (the tiny DeepSeek's too); a narrower row is checked
# too.
LAYOUTS = [LatentRowLayout(512, 64), LatentRowLayout(32, 16)]
TINY_DEEPSEEK_ROPE = {
    "rope_type": "deepseek_yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}
ATOL = 2e-3


def make_rope(rope_dim: int, neox: bool = False):
    return get_rope(
        rope_dim,
        max_position=4096,
        rope_parameters=dict(TINY_DEEPSEEK_ROPE),
        is_neox_style=neox,
        dtype=torch.float32,
    )


def k_pe_at(rope, positions: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """VLLM's own k_pe [n, rope_dim] of unrotated `raw` at `positions`."""
    key = raw[:, None].clone()
    _, out = rope.forward_native(positions, torch.zeros_like(key), key)
    return out[:, 0]


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda x: f"{x.kv_lora_rank}+{x.rope_dim}"
)
@pytest.mark.parametrize("neox", [False, True], ids=["gptj", "neox"])
def test_load_copies_kv_c_and_rotates_k_pe_to_the_real_position(
    vllm_config_context, layout, neox
):
    rope = make_rope(layout.rope_dim, neox)
    rotation = RopeRotation(rope)
    assert rotation.magnitude == pytest.approx(rope.mscale) and rope.mscale > 1.03
    gen = torch.Generator().manual_seed(0)
    n = 48
    p = torch.randint(0, 1600, (n,), generator=gen)
    d = torch.randint(-1600, 1600, (n,), generator=gen).clamp(min=-p)
    kv_c = torch.randn(n, layout.kv_lora_rank, generator=gen)
    raw = torch.randn(n, layout.rope_dim, generator=gen)
    stored = torch.cat((kv_c, k_pe_at(rope, p, raw)), dim=-1)

    moved_kv_c, moved_k_pe = reposition_latent_rows(layout, rotation, stored, d)

    assert torch.equal(moved_kv_c, kv_c)  # bit for bit: no position in it
    truth = k_pe_at(rope, p + d, raw)
    torch.testing.assert_close(moved_k_pe, truth, atol=ATOL, rtol=0)
    # The test would notice a missing rotation, and mscale applied twice.
    assert (stored[:, layout.kv_lora_rank :] - truth).abs().max() > 0.1
    assert (moved_k_pe * rope.mscale - truth).abs().max() > 10 * ATOL


def test_bf16_rows_keep_kv_c_and_round_k_pe_once(vllm_config_context):
    layout = LAYOUTS[0]
    rotation = RopeRotation(make_rope(layout.rope_dim))
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(16, layout.width, generator=gen).to(torch.bfloat16)
    deltas = torch.arange(16) * 97
    kv_c, k_pe = reposition_latent_rows(layout, rotation, rows, deltas)
    assert kv_c.dtype == k_pe.dtype == torch.bfloat16
    assert torch.equal(kv_c, rows[:, : layout.kv_lora_rank])
    expected = rotation.rotate(rows[:, None, layout.kv_lora_rank :].float(), deltas)[
        :, 0
    ]
    assert torch.equal(
        k_pe, expected.to(torch.bfloat16)
    )  # rotated in fp32, one rounding
    # A zero delta leaves the row as it was.
    _, same = reposition_latent_rows(
        layout, rotation, rows, torch.zeros(16, dtype=torch.long)
    )
    assert torch.equal(same, rows[:, layout.kv_lora_rank :])


def test_rows_and_ropes_of_other_widths_are_refused(vllm_config_context):
    layout = LatentRowLayout(32, 16)
    with pytest.raises(ValueError, match="48 wide .*got 40"):
        layout.split(torch.zeros(2, 40))
    other = RopeRotation(make_rope(64))
    with pytest.raises(ValueError, match="rotates 64 of 64 .* k_pe has 16"):
        reposition_latent_rows(
            layout, other, torch.zeros(2, 48), torch.zeros(2, dtype=torch.long)
        )
