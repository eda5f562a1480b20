"""Generate a deterministic tiny random DeepSeek-V3-style model (MLA + MoE).

Run by `./fork models` with the fork's venv Python:  python make_tiny_deepseek.py <output dir>
Same output on every run (fixed seed; the tokenizer is the tiny Llama's, built the same way).

What it exercises (docs/design/mla.md): multi-head latent attention with q and kv LoRA ranks,
the latent row of DeepSeek-V3 (kv_c 512 + k_pe 64: vLLM's CPU MLA decode kernel takes only
that), decoupled RoPE in GPT-J interleaved style (`rope_interleave`), DeepSeek's
YaRN with *different* `mscale` and `mscale_all_dim` (so the rope's cos/sin carry a magnitude
other than 1, which a re-rotation must not apply twice), one dense layer then MoE layers with a
shared expert. Weights are random: only exactness (not quality) is meaningful. vLLM 0.32 serves
it on the CPU (CPU_MLA); vLLM 0.23 has no MLA on the CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

from make_tiny_llama import VOCAB_SIZE, make

# Kept small and public: tests rebuild vLLM's rope object from these.
ROPE_PARAMETERS = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}


def shared_config() -> dict:
    """The config of the tiny DeepSeek, shared with the tiny DeepSeek-V3.2
    (make_tiny_deepseek_v32.py adds the indexer)."""
    return dict(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=1.0, norm_topk_prob=True,
        q_lora_rank=48, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64,
        v_head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters=dict(ROPE_PARAMETERS),
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
        # NOTE: as for the tiny Llama, a larger init spreads the logits so greedy choices
        # (and the V3.2 indexer's top-k) are not near-ties that float rounding could flip.
        initializer_range=0.1,
    )


def build_model(out: Path) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        **shared_config(), rope_interleave=True, num_nextn_predict_layers=0,
        # What vLLM reads to build V3's router (HF's V3 always routes this way).
        topk_method="noaux_tc", scoring_func="sigmoid",
    )
    model = DeepseekV3ForCausalLM(config).to(torch.float32)
    # NOTE: the router's correction bias is zero-initialised; a random one makes the
    # top-k expert choice depend on it too, as in trained checkpoints.
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    make(Path(sys.argv[1]), "tiny-deepseek", build_model)
