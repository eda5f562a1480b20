# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures of the chunk-cache unit tests (CPU only, no hub access)."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

_CORPUS = [
    "You are a helpful assistant. Answer the question using the documents.",
    "The quick brown fox jumps over the lazy dog. C# and F# are languages.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "系统提示：你是一个有用的助手。文档一：北京是中国的首都。问题：首都是哪里？",
    "Ünïcödé téxt wîth àccents, emoji 🙂 and symbols ## § ¶ ……",
    "what is the answer? the answer is forty two. documents chunks question",
]


def build_toy_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE built offline; prepends <s> like Llama."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="session")
def toy_tokenizer() -> PreTrainedTokenizerFast:
    return build_toy_tokenizer()


@pytest.fixture(scope="session")
def vllm_config_context():
    """VLLM's rotary embeddings are CustomOps: they need a current config.

    NOTE: VllmConfig() has no model config; LongRoPE only reads
    `model_config.max_model_len` from it, so a plain namespace carries that
    one number (tests that need it set `max_model_len`).
    """
    import types

    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    config.model_config = types.SimpleNamespace(max_model_len=2048)
    with set_current_vllm_config(config):
        yield config


# The CPU tier of a base without a CPU build (tests/unit/cpu_tier.py): what needs vLLM's
# CPU platform or ops is reported as skipped, with that reason.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    from tests.unit import cpu_tier

    outcome = yield
    report = outcome.get_result()
    reason = cpu_tier.skip_reason(call.excinfo) if report.failed else None
    if reason is not None:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")


def pytest_collection_modifyitems(config, items):
    from tests.unit import cpu_tier

    for item in items:
        if cpu_tier.needs_cpu_ops(item.nodeid):
            item.add_marker(pytest.mark.skip(reason=cpu_tier.CPU_OPS_REASON))
