"""Generate a deterministic tiny random DeepSeek-V3.2-style model (MLA + the DSA indexer).

Run by `./fork models` with the fork's venv Python:  python make_tiny_deepseek_v32.py <out dir>
Same output on every run (fixed seed; the tokenizer is the tiny Llama's, built the same way).

The tiny DeepSeek (make_tiny_deepseek.py: V3's latent row 512 + 64, DeepSeek's YaRN with
mscale != mscale_all_dim, one dense layer then MoE) plus V3.2's lightning indexer in every
layer (docs/design/sparse.md): `wq_b` (q_lora_rank -> heads x 128), `wk` (hidden -> 128),
`k_norm` (LayerNorm), `weights_proj` (hidden -> heads), the rope on the key's first 64 values
(neox: HF's rotate_half, vLLM's `indexer_rope_interleave` unset), and `index_topk` = 6, far
below the prompts' lengths, so the selection decides what each query attends to. Random
weights: only exactness is meaningful. No CPU backend of vLLM runs sparse attention (0.32:
"Sparse Attention is not supported on CPU"; 0.23 has no MLA on the CPU): this model is for
the reference tests (tests/e2e/test_sparse_reference.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from make_tiny_deepseek import shared_config
from make_tiny_llama import make

INDEX_TOPK = 6
# NOTE: the indexer sums relu(q_h . k) over its heads: with few heads a key often scores
# exactly 0 (every head negative, 1 in 2^heads), and top-k picks among such exact ties by
# index order, an implementation detail. 32 heads (V3.2: 64) make that rare.
INDEX_HEADS = 32


def build_model(out: Path) -> None:
    import torch
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV32Config(
        **shared_config(),
        index_topk=INDEX_TOPK, index_head_dim=128, index_n_heads=INDEX_HEADS,
    )
    model = DeepseekV32ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
        # NOTE: LayerNorm's default affine (1, 0) would be left as is by the init; a random
        # one makes k_norm a real part of the key (a reference that skipped it would show).
        for layer in model.model.layers:
            layer.self_attn.indexer.k_norm.weight.normal_(1.0, 0.2)
            layer.self_attn.indexer.k_norm.bias.normal_(0.0, 0.2)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    # NOTE: vLLM reads V3.2's indexer from these keys; HF's config class writes them too.
    # `num_nextn_predict_layers` 0: no MTP layer.
    import json
    cfg = json.loads((out / "config.json").read_text())
    cfg.setdefault("num_nextn_predict_layers", 0)
    cfg.setdefault("topk_method", "noaux_tc")
    cfg.setdefault("scoring_func", "sigmoid")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


if __name__ == "__main__":
    make(Path(sys.argv[1]), "tiny-deepseek-v32", build_model)
