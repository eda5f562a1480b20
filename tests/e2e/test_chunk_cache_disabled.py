"""Without --enable-chunk-cache the fork is stock vLLM (issue 4, acceptance 7):
a prompt containing the separator is tokenized as one string, no connector is
configured, and outputs equal a plain HF causal forward (float32)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import models_dir
from tests.e2e.chunk_reference import Reference, compare
from tests.e2e.engine import close_llm, make_llm

pytestmark = pytest.mark.e2e

MODEL = str(models_dir() / "tiny-llama")
TOL = 1e-3


@pytest.fixture(scope="module")
def llm():
    llm = make_llm(MODEL)
    yield llm
    close_llm(llm)


def test_no_connector_is_configured(llm):
    config = llm.llm_engine.vllm_config
    assert not config.chunk_cache_config.enable_chunk_cache
    assert config.kv_transfer_config is None


@pytest.mark.parametrize(
    "text", ["sys ## doc one ## doc two ## question", "a plain prompt", "##"]
)
def test_outputs_equal_a_plain_causal_forward(llm, text):
    from vllm import SamplingParams

    reference = Reference(MODEL)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    out = llm.generate([text], params, use_tqdm=False)[0]
    ids = reference.tokenizer.encode(text)
    assert list(out.prompt_token_ids) == ids
    tokens = list(out.outputs[0].token_ids)
    with torch.no_grad():
        logits = reference.model(input_ids=torch.tensor([ids + tokens])).logits[0]
    ref = torch.log_softmax(logits.double(), -1)[len(ids) - 1 :]
    compare(ref, tokens, out.outputs[0].logprobs, TOL)


def test_prompt_logprobs_work_as_usual(llm):
    from vllm import SamplingParams

    out = llm.generate(
        ["sys ## doc ## q"],
        SamplingParams(max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )[0]
    assert out.prompt_logprobs is not None


def test_prompt_segments_are_refused_naming_the_flag(llm):
    """A prompt given as segments needs the chunk cache: a validation error
    that says so, not a failure on the missing "prompt"."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="--enable-chunk-cache"):
        llm.generate(
            [{"prompt_segments": ["sys", "doc", "q"]}],
            SamplingParams(max_tokens=1),
            use_tqdm=False,
        )
