"""The tiny DeepSeek-V3 (MLA) through the real engine, on the CPU (issue 22).

* With --enable-chunk-cache it is refused at start-up by name, on both bases (the MLA data
  path is not built: docs/design/mla.md).
* Without it: vLLM 0.32 serves it with its CPU_MLA backend and must give what HF
  transformers gives (greedy tokens, logprobs within the engine tests' tolerance). That is
  the ground a CPU test of the MLA data path stands on. vLLM 0.23 has no MLA on the CPU
  and must say so when asked to start it.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import models_dir
from tests.e2e.engine import close_llm, make_llm

pytestmark = pytest.mark.e2e

MODEL = str(models_dir() / "tiny-deepseek")
PROMPT = "the city of the river north cache chunk model token paper story question"
TOL = 1e-3


def _vllm_minor() -> str:
    import vllm

    return ".".join(vllm.__version__.split(".")[:2])


def test_the_chunk_cache_refuses_an_mla_model_at_start_up():
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=MODEL, dtype="float32", enforce_eager=True, max_model_len=1024,
                      enable_chunk_cache=True)
    with pytest.raises(ValueError, match=r"does not support MLA attention yet .*mla\.md"):
        args.create_engine_config()


def test_vllm_serves_the_tiny_deepseek_as_hf_transformers_computes_it():
    if _vllm_minor() == "0.23":
        # vLLM 0.23's CPU platform: "MLA is not supported on CPU."
        with pytest.raises(Exception, match="MLA is not supported on CPU"):
            make_llm(MODEL, max_model_len=1024)
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    llm = make_llm(MODEL, max_model_len=1024)
    try:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, logprobs=5),
                           use_tqdm=False)[0].outputs[0]
    finally:
        close_llm(llm)
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    prompt_ids = AutoTokenizer.from_pretrained(MODEL).encode(PROMPT)
    generated = list(out.token_ids)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + generated])).logits[0].double()
    rows = torch.log_softmax(logits, -1)[len(prompt_ids) - 1:-1]
    assert rows.argmax(-1).tolist() == generated
    worst = max(abs(lp.logprob - float(rows[step, token]))
                for step, top in enumerate(out.logprobs) for token, lp in top.items())
    assert worst < TOL, worst
