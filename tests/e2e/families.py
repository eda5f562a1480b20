"""Tiny random models of the families vLLM users serve (issue 42), generated
offline from transformers' own config classes (no download): 2-3 layers,
hidden 128 (head size 32: CPU_ATTN has no 16), the tiny Llama's tokenizer (vocabulary
512, BOS 1, EOS 2).

Each family keeps what is special about it (the `special` text, which the
user guide's matrix repeats): QK-norm, qkv bias, partial rotary, LongRoPE,
sliding windows (shorter than a chunk, longer than the prompt), Gemma 2's
soft-capping, Gemma 3's two rotary bases, MoE, Granite's multipliers,
absolute position embeddings. Weights are random: only exactness is
meaningful. `build(name, out)` writes one model directory.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB = 512
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=False,
    # NOTE: as for the tiny Llama: spread logits, no near-ties in greedy choices.
    initializer_range=0.1,
)
# Small windows: shorter than a chunk of the tests (a chunk is 5-40 words,
# ~10-120 tokens) and than their prompts.
SHORT_WINDOW = 8
MID_WINDOW = 24


@dataclass(frozen=True)
class Family:
    name: str
    special: str
    # -> (config, the model class's name in transformers: its modeling module is
    # imported only by build(), the dry runs need the config alone)
    make: Callable[[], Any]
    # None: served exactly (the engine runs and matches the reference);
    # else a regex of the start-up refusal's message.
    refused: str | None = None
    # vLLM release prefix -> a regex of the error stock vLLM (chunk cache off)
    # itself fails with on the CPU: the family cannot be run on that base.
    base_fails: tuple[tuple[str, str], ...] = ()
    # vLLM release prefix -> a regex of the start-up refusal on that base (served
    # on the others).
    base_refused: tuple[tuple[str, str], ...] = ()
    # Extra LLM(...) arguments of the family's engine.
    engine_args: tuple[tuple[str, Any], ...] = ()


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON, num_hidden_layers=2, head_dim=32), "LlamaForCausalLM"


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**_COMMON, num_hidden_layers=2), "Qwen2ForCausalLM"


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**_COMMON, num_hidden_layers=2, head_dim=32), "Qwen3ForCausalLM"


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return (
        Qwen3MoeConfig(
            **_COMMON,
            num_hidden_layers=2,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        ),
        "Qwen3MoeForCausalLM",
    )


def _mistral(window):
    def make():
        from transformers import MistralConfig

        return (
            MistralConfig(
                **_COMMON, num_hidden_layers=2, head_dim=32, sliding_window=window
            ),
            "MistralForCausalLM",
        )

    return make


# vLLM's Gemma models tie the LM head to the embeddings (an assert).
_TIED = {**_COMMON, "tie_word_embeddings": True}


def _gemma2():
    from transformers import Gemma2Config

    return (
        Gemma2Config(
            **_TIED,
            num_hidden_layers=2,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=SHORT_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
        ),
        "Gemma2ForCausalLM",
    )


def _gemma2_long():
    config, cls = _gemma2()
    config.sliding_window = 1024
    return config, cls


def _gemma3():
    from transformers import Gemma3TextConfig

    return (
        Gemma3TextConfig(
            **_TIED,
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=MID_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
        "Gemma3ForCausalLM",
    )


def _phi3():
    from transformers import Phi3Config

    half = 32 * 0.5 // 2  # rotary_dim / 2 factors (head_dim 32, partial 0.5)
    return (
        Phi3Config(
            **_COMMON,
            num_hidden_layers=2,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=1024,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(int(half))],
                "long_factor": [2.0 + 0.3 * i for i in range(int(half))],
                "original_max_position_embeddings": 1024,
            },
        ),
        "Phi3ForCausalLM",
    )


def _stablelm():
    from transformers import StableLmConfig

    return (
        StableLmConfig(**_COMMON, num_hidden_layers=2, partial_rotary_factor=0.25),
        "StableLmForCausalLM",
    )


def _glm4():
    from transformers import Glm4Config

    return (
        Glm4Config(
            **_COMMON, num_hidden_layers=2, head_dim=32, partial_rotary_factor=0.5
        ),
        "Glm4ForCausalLM",
    )


def _olmo2():
    from transformers import Olmo2Config

    return Olmo2Config(**_COMMON, num_hidden_layers=2), "Olmo2ForCausalLM"


def _granite():
    from transformers import GraniteConfig

    return (
        GraniteConfig(
            **_COMMON,
            num_hidden_layers=2,
            embedding_multiplier=2.0,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            logits_scaling=4.0,
        ),
        "GraniteForCausalLM",
    )


def _gpt2():
    from transformers import GPT2Config

    return (
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=128,
            n_layer=2,
            n_head=4,
            n_positions=4096,
            bos_token_id=1,
            eos_token_id=2,
            initializer_range=0.1,
        ),
        "GPT2LMHeadModel",
    )


FAMILIES = {
    f.name: f
    for f in (
        Family("llama", "plain RoPE (the reference family)", _llama),
        Family("qwen2", "qkv bias", _qwen2),
        Family("qwen3", "QK-norm (RMSNorm on q and k before RoPE)", _qwen3),
        Family(
            "qwen3-moe",
            "QK-norm, mixture of experts",
            _qwen3_moe,
            # NOTE: vLLM 0.23's CPU fused MoE builds a CustomOp during the forward
            # (select_experts) outside the config context: its profile run fails.
            base_fails=(("0.23", "Current vLLM config is not set"),),
        ),
        Family("mistral", "no sliding window (full attention)", _mistral(None)),
        Family(
            "mistral-window-4096",
            "sliding window 4096 = max_model_len (full attention)",
            _mistral(4096),
        ),
        Family(
            "mistral-window",
            f"sliding window {MID_WINDOW} on every layer (shorter than the prompt)",
            _mistral(MID_WINDOW),
        ),
        Family(
            "gemma2",
            f"sliding window {SHORT_WINDOW} (shorter than a chunk) on alternate "
            "layers, attention and final logit soft-capping",
            _gemma2,
        ),
        Family(
            "gemma2-window-1024",
            "Gemma 2 with a window of 1024 (longer than every "
            "prompt, shorter than max_model_len)",
            _gemma2_long,
        ),
        Family(
            "gemma3",
            f"sliding window {MID_WINDOW} on 2 of 3 layers, two rotary bases "
            "(local 1e4, global 1e6), QK-norm",
            _gemma3,
        ),
        Family(
            "phi3",
            "partial rotary 0.5, LongRoPE scaling (short factors, magnitude "
            "factor in cos/sin)",
            _phi3,
            # NOTE: with max_model_len above original_max_position_embeddings vLLM
            # rotates every position with the long factors, HF only past the
            # original length: stock vLLM (chunk cache off) then differs from HF
            # by ~0.4 in logprobs. At 1024 both use the short factors.
            engine_args=(("max_model_len", 1024),),
        ),
        Family("stablelm", "partial rotary 0.25, LayerNorm", _stablelm),
        Family("glm4", "partial rotary 0.5 (GPT-J interleaved pairs)", _glm4),
        Family(
            "olmo2",
            "QK-norm over all heads, post-norms",
            _olmo2,
            # NOTE: vLLM 0.32 maps Olmo2ForCausalLM to its Transformers modeling
            # backend (transformers' attention applies the rope).
            base_refused=(
                (
                    "0.32",
                    r"the model runs on vLLM's Transformers modeling "
                    r"backend \(TransformersForCausalLM\), which applies RoPE "
                    "inside transformers' attention code",
                ),
            ),
        ),
        Family("granite", "embedding/attention/residual/logit multipliers", _granite),
        Family(
            "gpt2",
            "learned absolute position embeddings, no RoPE",
            _gpt2,
            refused=r"attention layer\(s\) \['transformer\.h\.0\.attn\.attn'.*have no "
            "rotary embedding",
        ),
    )
}


def build(name: str, out: Path, tokenizer_dir: Path) -> Path:
    """Write family `name`'s tiny random model (seed 0) and the tiny Llama's
    tokenizer into `out`; returns `out`."""
    import torch
    import transformers

    family = FAMILIES[name]
    out.mkdir(parents=True, exist_ok=True)
    for item in tokenizer_dir.iterdir():
        if (
            item.name.startswith(("tokenizer", "special_tokens"))
            or item.name == "chat_template.jinja"
        ):
            shutil.copy(item, out / item.name)
    torch.manual_seed(0)
    config, cls_name = family.make()
    model = getattr(transformers, cls_name)(config).to(torch.float32).eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    (out / "fork-model.json").write_text(json.dumps({"name": name, "seed": 0}) + "\n")
    return out
