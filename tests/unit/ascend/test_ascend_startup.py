"""Start-up on vllm-ascend's code path without an NPU (issue 29): vllm-ascend's real
plugin entry point and patch modules, its rope classes, custom ops and attention
backends, the fork's start-up checks on the models its users serve, a stock vLLM next
to vllm-ascend. The check scripts run in subprocesses with the stub `torch_npu`
(npu_plugin_checks.py says what is real and what stands in); nothing here executes
an NPU op, and docs/ascend.md lists what never ran."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import REPO, models_dir
from tests.unit.ascend.ascend_checks import CheckOutcome, run_check, run_checks

SCRIPT = "npu_plugin_checks.py"
LLAMA = str(models_dir() / "tiny-llama")


def test_vllm_ascend_plugin_is_harmless_on_a_stock_vllm(
    ascend_tree: Path, stock_vllm: Path
):
    """Finding 3: before, every start with vllm-ascend next to a stock vLLM failed
    (the patched register_connector imported the fork's chunk cache first)."""
    run_check(SCRIPT, "check_plugin_on_stock_vllm", ascend_tree, first=stock_vllm)


def test_vllm_ascends_runner_serves_a_stock_connector_on_a_stock_vllm(
    ascend_tree: Path, stock_vllm: Path
):
    """Finding 3, the runner half: before, vllm-ascend's patched initialize_kv_cache
    called the fork's register_model on any KV connector: on a stock vLLM every start
    with one (e.g. PD disaggregation) failed with an AttributeError."""
    run_check(
        SCRIPT,
        "check_npu_runner_serves_a_stock_connector_on_stock_vllm",
        ascend_tree,
        first=stock_vllm,
    )


BUFFERS = "check_deepseek_load_buffers_allocated_in_register_kv_caches"
COS_SIN = "check_deepseek_load_step_forms_cos_sin_once_per_frequencies"


@pytest.fixture(scope="module")
def batch(ascend_tree: Path) -> dict[str, CheckOutcome]:
    """The checks that need no stock vLLM first on the path, as one batch (each in a
    child forked after the imports: check_batch.py)."""
    return run_checks(
        SCRIPT,
        ["check_scheduler_rules", "check_xlite_refused", BUFFERS, COS_SIN],
        ascend_tree,
        args={
            "check_scheduler_rules": [LLAMA],
            BUFFERS: [str(models_dir())],
            COS_SIN: [str(models_dir())],
        },
    )


def test_schedulers_that_replace_schedule_are_refused_with_boundary_recompute(batch):
    """Finding 1 (the refusal half; the admission half runs an engine:
    tests/e2e/test_ascend_schedulers.py)."""
    batch["check_scheduler_rules"].assert_ok("check_scheduler_rules")


def test_xlite_graph_mode_is_refused_at_start_up(batch):
    """Finding 4: xlite computes attention outside vLLM's layers (zeros loaded)."""
    batch["check_xlite_refused"].assert_ok("check_xlite_refused")


@pytest.fixture(scope="module")
def dry_run(ascend_tree: Path) -> str:
    """One subprocess for the dry run of the start-up: the models below, then every
    family of the model-family matrix (its imports dominate: one process for both)."""
    return run_check(
        SCRIPT,
        "check_dry_run",
        ascend_tree,
        str(models_dir()),
        str(REPO / "tests" / "e2e" / "families.py"),
    )


def test_dry_run_of_the_start_up_on_vllm_ascend(dry_run: str):
    """Acceptance: Llama, Qwen2.5, Qwen3, Qwen3-MoE (vllm-ascend's patched attention
    forward, finding 2) and the tiny DeepSeek (Ascend MLA) are accepted; Qwen3 with
    an M-RoPE is refused naming AscendMRotaryEmbedding."""
    assert "qwen3-mrope refused" in dry_run


def test_deepseek_on_ascend_mla_allocates_its_latent_load_buffers_in_register_kv_caches(
    batch,
):
    """Finding 10, on vllm-ascend's AscendMLAImpl and rope (npu_plugin_checks.py).
    Against the code before 98e9514 (reinstated one part at a time): the lazy allocation
    fails with `AssertionError: {}` (no buffer after register_kv_caches); the K/V sizing
    of load_scratch_bytes with `AssertionError: (29360128, 132120576)` (allocated vs
    counted); the per-layer MLA load with `a load took tensors of its own`."""
    batch[BUFFERS].assert_ok(BUFFERS)


def test_deepseek_on_ascend_mla_forms_a_steps_cos_sin_once_per_frequencies(batch):
    """Finding 8, on the with_pairing copies vllm-ascend's MLA reader makes of its
    AscendDeepseekScalingRotaryEmbedding (npu_plugin_checks.py). Against the code
    before 98e9514 (the step's cos/sin keyed by id(rotation), its cos_sin_rows):
    `AssertionError: ['cos_sin_rows', 'cos_sin_rows', 'cos_sin_rows']` (one per layer);
    with today's cos_sin_rows (host deltas), `a device value was read back on the host`.
    NOTE: the old code read back only on a device other than CPU and CUDA; on these CPU
    tensors the old code fails by its per-layer formation (docs/ascend.md)."""
    batch[COS_SIN].assert_ok(COS_SIN)


# ------------------------------------------------- the model-family matrix (issue 42)

# What each family of tests/e2e/families.py gets at start-up on vllm-ascend's code
# path (its custom ops, rope classes and NPUPlatform's attention backend): accepted
# with the rope below, or refused with the message the regex matches. From the
# documented rules (docs/ascend.md, "The model-family matrix on Ascend"): a window
# shorter than max_model_len is shown exact on CPU_ATTN, TRITON_ATTN and FLASH_ATTN
# only, so it is refused on Ascend's attention naming the layer and the backend (the
# worker's check runs before the scheduler's); a window of at least max_model_len is
# full attention; a model without RoPE is refused naming its layers.
_WINDOW = (
    r"chunk cache does not support sliding-window attention "
    r"\(model\.layers\.0\.self_attn\.attn, window {}\) on the attention backend "
    r"AscendAttentionBackendImpl: windowed layers are shown exact on "
    r"CPUAttentionBackendImpl, TritonAttentionImpl, FlashAttentionImpl only"
)
# Accepted: the rope found for every layer (class, rotary_dim, neox pairing) from
# the family's config (head size 32 times its partial rotary factor; GLM-4's GPT-J
# pairs; Phi-3's LongRoPE is vLLM's own class, which vllm-ascend does not replace).
_PLAIN = "AscendRotaryEmbedding(base 10000.0, rotary_dim 32, neox True)"
ASCEND_FAMILIES = {
    "llama": _PLAIN,
    "qwen2": _PLAIN,
    "qwen3": _PLAIN,
    "qwen3-moe": _PLAIN,
    "mistral": _PLAIN,
    "mistral-window-4096": _PLAIN,
    "olmo2": _PLAIN,
    "granite": _PLAIN,
    "phi3": "Phi3LongRoPEScaledRotaryEmbedding(base 10000.0, rotary_dim 16, neox None)",
    "stablelm": "AscendRotaryEmbedding(base 10000.0, rotary_dim 8, neox True)",
    "glm4": "AscendRotaryEmbedding(base 10000.0, rotary_dim 16, neox False)",
    "mistral-window": _WINDOW.format(24),
    "gemma2": _WINDOW.format(8),
    "gemma2-window-1024": _WINDOW.format(1024),
    "gemma3": _WINDOW.format(24),
    "gpt2": r"attention layer\(s\) \['transformer\.h\.0\.attn\.attn'.*have no "
    r"rotary embedding",
}

_REFUSED = {"mistral-window", "gemma2", "gemma2-window-1024", "gemma3", "gpt2"}


@pytest.fixture(scope="module")
def ascend_families(dry_run: str) -> dict[str, dict]:
    """What each family got at start-up on vllm-ascend's code path
    (npu_plugin_checks._family_dry_run, in the dry run's process)."""
    found = {}
    for line in dry_run.splitlines():
        if line.startswith("FAMILY "):
            result = json.loads(line[len("FAMILY ") :])
            found[result.pop("name")] = result
    return found


def test_ascend_family_table_covers_the_matrix():
    from tests.e2e.families import FAMILIES

    assert set(ASCEND_FAMILIES) == set(FAMILIES)


@pytest.mark.parametrize("name", sorted(ASCEND_FAMILIES))
def test_family_starts_or_is_refused_on_vllm_ascend(ascend_families, name):
    """Each family accepted on vllm-ascend's attention and rope classes, or refused
    at start-up with the documented message (docs/ascend.md)."""
    result = ascend_families[name]
    expected = ASCEND_FAMILIES[name]
    print(name, result)
    if name not in _REFUSED:
        assert result["accepted"], result
        assert result["impls"] == ["AscendAttentionBackendImpl"], result
        # A window of max_model_len keeps vLLM's SlidingWindowSpec (every layer
        # windowed), which frees nothing: served as full attention.
        spec = (
            "SlidingWindowSpec"
            if name == "mistral-window-4096"
            else "FullAttentionSpec"
        )
        assert result["specs"] == [spec], result
        assert result["ropes"] == [expected], result
    else:
        assert not result["accepted"], result
        assert result["type"] == "ValueError", result
        assert re.search(expected, result["message"]), result
