"""The tiny DeepSeek-V3 (MLA) through the real engine, on the CPU (issue 22).

* With --enable-chunk-cache: served from the latent pool on vLLM 0.32 (exactness: the
  DeepSeek rows of test_chunk_cache_exactness.py); sparse MLA (V3.2) is refused at
  start-up.
* Without it: vLLM 0.32 serves it with its CPU_MLA backend (asked for by name: on a CPU
  with AMX vLLM would pick AMX_MLA, tests/e2e/engine.py) and must give what HF
  transformers gives (greedy tokens, logprobs within the engine tests' tolerance). That
  is the ground a CPU test of the MLA data path stands on. vLLM 0.23 has no MLA on the
  CPU and must say so when asked to start it.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import models_dir
from tests.e2e.engine import CPU_MLA_ARGS, close_llm, make_llm

pytestmark = pytest.mark.e2e

MODEL = str(models_dir() / "tiny-deepseek")
PROMPT = "the city of the river north cache chunk model token paper story question"
TOL = 1e-3


def _vllm_minor() -> str:
    import vllm

    return ".".join(vllm.__version__.split(".")[:2])


def test_sparse_mla_is_refused_at_start_up():
    # DeepSeek-V3.2's indexer keeps keys of its own that the chunk cache does not move
    # yet.
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=MODEL,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        enable_chunk_cache=True,
        hf_overrides={"index_topk": 16},
    )
    with pytest.raises(ValueError, match=r"does not support sparse MLA attention yet"):
        args.create_engine_config()


def test_the_chunk_cache_serves_mla_where_vllm_has_it_on_the_cpu():
    """VLLM 0.32: an engine with the chunk cache starts on the tiny DeepSeek and serves
    a chunked prompt's documents from its latent pool (exactness: the DeepSeek rows of
    test_chunk_cache_exactness.py). vLLM 0.23: its own refusal, with or without it."""
    from vllm import SamplingParams

    if _vllm_minor() == "0.23":
        with pytest.raises(Exception, match="MLA is not supported on CPU"):
            make_llm(MODEL, max_model_len=1024, enable_chunk_cache=True)
        return
    llm = make_llm(MODEL, max_model_len=1024, enable_chunk_cache=True, **CPU_MLA_ARGS)
    try:
        prompt = (
            "the system ## a document about the river ## another one on the city ## why"
        )
        out = llm.generate(
            [prompt, prompt],
            SamplingParams(max_tokens=2, temperature=0),
            use_tqdm=False,
        )
    finally:
        close_llm(llm)
    for request in out:
        assert request.num_cached_tokens > 0  # the documents came from the latent pool
    assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids


def test_vllm_serves_the_tiny_deepseek_as_hf_transformers_computes_it():
    if _vllm_minor() == "0.23":
        # vLLM 0.23's CPU platform: "MLA is not supported on CPU."
        with pytest.raises(Exception, match="MLA is not supported on CPU"):
            make_llm(MODEL, max_model_len=1024)
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    llm = make_llm(MODEL, max_model_len=1024, **CPU_MLA_ARGS)
    try:
        out = llm.generate(
            [PROMPT],
            SamplingParams(max_tokens=8, temperature=0, logprobs=5),
            use_tqdm=False,
        )[0].outputs[0]
    finally:
        close_llm(llm)
    hf = AutoModelForCausalLM.from_pretrained(
        MODEL, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt_ids = AutoTokenizer.from_pretrained(MODEL).encode(PROMPT)
    generated = list(out.token_ids)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + generated])).logits[0].double()
    rows = torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]
    assert rows.argmax(-1).tolist() == generated
    worst = max(
        abs(lp.logprob - float(rows[step, token]))
        for step, top in enumerate(out.logprobs)
        for token, lp in top.items()
    )
    assert worst < TOL, worst
