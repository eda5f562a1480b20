"""On the GPU machine: the models of the GPU run, generated (no download, no network).

    python tools/gpu/make_models.py OUT_DIR [NAME...]      (default: all of them)

* gpu-llama: tiny-llama's tokenizer and recipe (tools/models/make_tiny_llama.py) with
  head_dim 64, the smallest head size every CUDA attention backend of vLLM 0.23 takes;
* llama3-8b: Llama-3-8B's config for load_format="dummy" (benchmarks/gpu_ttft.py);
* gpu-deepseek: the tiny DeepSeek-V3 (tools/models/make_tiny_deepseek.py) reshaped so that
  vLLM 0.23 can run it on CUDA with what the slim pack carries (docs/gpu.md, "Next run");
* gpu-window: gpu-llama's shapes as a Mistral with a sliding window of 24 on every layer.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

# NOTE: why the tiny DeepSeek itself cannot run on vLLM 0.23 on a Hopper GPU:
# * its MLA prefill goes through FlashAttention (the only MLA prefill backend vLLM 0.23 lists
#   for SM90, attention/backends/mla/prefill/selector.py), FA3 on Hopper, which takes the
#   prefill's q/k head (qk_nope + qk_rope = 16 + 64 = 80) and v head (16) unpadded, and FA3
#   refuses that pair: "If V headdim is different from Q/K dim, we only support Q/K headdim
#   in (128, 192] and V headdim in (96, 128], or (Q/K <= 64 and V <= 512)" (a check in
#   _vllm_fa3_C.abi3.so). DeepSeek-R1's 128 + 64 / 128 is inside that range;
# * its MoE layers need vLLM's _moe_C extension (moe_align_block_size, top-k), 39 MiB of
#   xz that the slim pack leaves out: every layer here is dense (first_k_dense_replace).
GPU_DEEPSEEK_OVERRIDES = dict(qk_nope_head_dim=128, v_head_dim=128, num_hidden_layers=3,
                              first_k_dense_replace=3)


def _build_small(out: Path, family: str, **extra) -> None:
    """tiny-llama's tokenizer with head_dim 64 (the smallest head size every CUDA
    attention backend of vLLM 0.23 takes), as a Llama or a Mistral."""
    import torch
    import transformers

    import make_tiny_llama

    out.mkdir(parents=True, exist_ok=True)
    make_tiny_llama.build_tokenizer(out)
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=make_tiny_llama.VOCAB_SIZE, hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=2, tie_word_embeddings=False, initializer_range=0.1, **extra)
    model = getattr(transformers, f"{family}ForCausalLM")(config).to(torch.float32)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)


def build_gpu_llama(out: Path) -> None:
    _build_small(out, "Llama")


def build_gpu_window(out: Path) -> None:
    """gpu-llama's shapes as a Mistral whose every layer has a sliding window of 24 keys
    (tests/e2e/families.py's MID_WINDOW): shorter than the prompts and their chunks, so a
    loaded chunk's keys fall out of later tokens' windows (issue 52, window-triton)."""
    _build_small(out, "Mistral", sliding_window=24)


def build_gpu_deepseek(out: Path) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    import make_tiny_deepseek
    import make_tiny_llama

    out.mkdir(parents=True, exist_ok=True)
    make_tiny_llama.build_tokenizer(out)
    torch.manual_seed(0)
    config = DeepseekV3Config(
        **{**make_tiny_deepseek.shared_config(), **GPU_DEEPSEEK_OVERRIDES},
        rope_interleave=True, num_nextn_predict_layers=0,
        topk_method="noaux_tc", scoring_func="sigmoid")
    model = DeepseekV3ForCausalLM(config).to(torch.float32)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)


def main(out: Path, names: list[str]) -> None:
    import os

    import gpu_ttft

    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic BPE merges

    builders = {"gpu-llama": build_gpu_llama, "gpu-deepseek": build_gpu_deepseek,
                "gpu-window": build_gpu_window}
    for name in names or [*builders, "llama3-8b"]:
        if name == "llama3-8b":
            if not (out / "gpu-llama").exists():
                build_gpu_llama(out / "gpu-llama")
            gpu_ttft.make_model_dir(out / "llama3-8b", out / "gpu-llama")
        else:
            builders[name](out / name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
