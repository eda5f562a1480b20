"""Generate a deterministic tiny random Llama with its own small BPE tokenizer.

Run by `./fork models` with the fork's venv Python:  python make_tiny_llama.py <output dir>
Same output on every run: fixed corpus, fixed seed, single-threaded tokenizer training.
Fast tests use it; its weights are random, so only exactness (not quality) is meaningful.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = ("the a of and to in is was for on that with as by at from it an be this are or "
         "which his her their city river north south cache chunk model token paper story "
         "question answer document system user assistant said time year people way day man "
         "thing woman life child world school state family group country problem hand part "
         "place case week company number point home water room mother area money month lot "
         "right study book eye job word business issue side kind head house service friend "
         "father power hour game line end member law car name president team minute idea "
         "kid body information back parent face others level office door health person art "
         "war history party result change morning reason research girl guy moment air teacher "
         "force education foot boy age policy music market sense nation plan college interest "
         "death experience effect use class control care field development role effort rate "
         "heart drug show leader light voice wife police mind price report decision son view "
         "## . , ? ! : ; ' \" ( ) 0 1 2 3 4 5 6 7 8 9 é ü 東京 日本").split()


def corpus(n_lines: int = 4000) -> list[str]:
    rng = random.Random(1234)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))
            for _ in range(n_lines)]


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=False,
        # NOTE: a larger init spreads the logits of a random model, so greedy choices are not
        # near-ties that float rounding could flip; tests compare tokens exactly.
        initializer_range=0.1,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)


def make(out: Path, name: str, model_builder) -> None:
    """The tokenizer, the model `model_builder(out)` saves, and the marker file."""
    os.environ["RAYON_NUM_THREADS"] = "1"  # deterministic BPE merges
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    model_builder(out)
    (out / "fork-model.json").write_text(json.dumps({"name": name, "seed": 0}) + "\n")


if __name__ == "__main__":
    make(Path(sys.argv[1]), "tiny-llama", build_model)
