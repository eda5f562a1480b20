"""TTFT on a GPU: stock vLLM vs vLLM prefix caching vs the chunk cache, on a
model with Llama-3-8B's shapes and random weights (load_format="dummy": no
download; timing does not need trained weights).

    python benchmarks/gpu_ttft.py MODE MODEL_DIR   # MODE: stock | prefix | chunk

Workload: a pool of 8 documents of ~DOC_TOKENS tokens; each request is
system ## 4 documents (a random choice, shuffled) ## question. Warm-up: 6
requests cover every document (the chunk cache and the prefix cache fill);
then 10 measured requests, one at a time, each with a new question and new
order of documents. TTFT = wall time of a generate() with max_tokens=1.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

DOC_TOKENS = int(os.environ.get("DOC_TOKENS", "1000"))

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def make_model_dir(out: Path, tokenizer_from: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(LLAMA3_8B))
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                            for _ in range(rng.randint(2, 7))) for _ in range(n))


def main() -> None:
    mode, model = sys.argv[1], sys.argv[2]
    from vllm import LLM, SamplingParams

    kwargs = dict(model=model, load_format="dummy", dtype="bfloat16", max_model_len=8192,
                  gpu_memory_utilization=0.85, seed=0,
                  enforce_eager=os.environ.get("TTFT_EAGER", "1") == "1")
    if mode == "stock":
        kwargs["enable_prefix_caching"] = False
    elif mode == "prefix":
        kwargs["enable_prefix_caching"] = True
    else:
        kwargs.update(enable_chunk_cache=True, enable_prefix_caching=True)
    t0 = time.time()
    llm = LLM(**kwargs)
    start_up = time.time() - t0
    tok = llm.get_tokenizer()
    rng = random.Random(0)
    docs = []
    for _ in range(8):
        text = words(rng, 20)
        while len(tok.encode(text, add_special_tokens=False)) < DOC_TOKENS:
            text += " " + words(rng, 5)
        docs.append(text)
    sep = " ## " if mode == "chunk" else " "  # stock/prefix: the same text, no markers

    def prompt(order):
        return sep.join(["answer from the documents", *[docs[i] for i in order],
                         "question: " + words(rng, 12)])

    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(6):
        order = [(2 * i + k) % 8 for k in range(4)]
        llm.generate([prompt(order)], params, use_tqdm=False)
    ttfts, cached, lengths = [], [], []
    for _ in range(10):
        order = rng.sample(range(8), 4)
        p = prompt(order)
        t = time.perf_counter()
        out = llm.generate([p], params, use_tqdm=False)[0]
        ttfts.append(time.perf_counter() - t)
        cached.append(out.num_cached_tokens or 0)
        lengths.append(len(out.prompt_token_ids))
    print(json.dumps({
        "mode": mode, "enforce_eager": kwargs["enforce_eager"], "start_up_s": round(start_up, 1),
        "prompt_tokens_mean": statistics.mean(lengths),
        "cached_tokens_mean": statistics.mean(cached),
        "ttft_ms_median": round(1e3 * statistics.median(ttfts), 1),
        "ttft_ms_min": round(1e3 * min(ttfts), 1), "ttft_ms_max": round(1e3 * max(ttfts), 1),
    }))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "make":
        make_model_dir(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
