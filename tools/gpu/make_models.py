"""On the GPU machine: the models of the GPU run, generated (no download, no network).

    python tools/gpu/make_models.py OUT_DIR

* gpu-llama: tiny-llama's tokenizer and recipe (tools/models/make_tiny_llama.py) with
  head_dim 64, the smallest head size every CUDA attention backend of vLLM 0.23 takes;
* llama3-8b: Llama-3-8B's config for load_format="dummy" (benchmarks/gpu_ttft.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def main(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import gpu_ttft
    import make_tiny_llama

    llama = out / "gpu-llama"
    make_tiny_llama.build_tokenizer(llama)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=make_tiny_llama.VOCAB_SIZE, hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=2, tie_word_embeddings=False, initializer_range=0.1)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.do_sample = False
    model.save_pretrained(llama, safe_serialization=True)
    gpu_ttft.make_model_dir(out / "llama3-8b", llama)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
