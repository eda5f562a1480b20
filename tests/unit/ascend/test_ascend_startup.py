"""Start-up on vllm-ascend's code path without an NPU (issue 29): vllm-ascend's real
plugin entry point and patch modules, its rope classes, custom ops and attention
backends, the fork's start-up checks on the models its users serve, a stock vLLM next
to vllm-ascend. The check scripts run in subprocesses with the stub `torch_npu`
(npu_plugin_checks.py says what is real and what stands in); nothing here executes
an NPU op, and docs/ascend.md lists what never ran."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import models_dir
from tests.unit.ascend.ascend_checks import run_check

SCRIPT = "npu_plugin_checks.py"
LLAMA = str(models_dir() / "tiny-llama")


def test_vllm_ascend_plugin_is_harmless_on_a_stock_vllm(ascend_tree: Path, stock_vllm: Path):
    """Finding 3: before, every start with vllm-ascend next to a stock vLLM failed
    (the patched register_connector imported the fork's chunk cache first)."""
    run_check(SCRIPT, "check_plugin_on_stock_vllm", ascend_tree, first=stock_vllm)


def test_vllm_ascends_runner_serves_a_stock_connector_on_a_stock_vllm(
        ascend_tree: Path, stock_vllm: Path):
    """Finding 3, the runner half: before, vllm-ascend's patched initialize_kv_cache
    called the fork's register_model on any KV connector: on a stock vLLM every start
    with one (e.g. PD disaggregation) failed with an AttributeError."""
    run_check(SCRIPT, "check_npu_runner_serves_a_stock_connector_on_stock_vllm",
              ascend_tree, first=stock_vllm)


def test_schedulers_that_replace_schedule_are_refused_with_boundary_recompute(
        ascend_tree: Path):
    """Finding 1 (the refusal half; the admission half runs an engine:
    tests/e2e/test_ascend_schedulers.py)."""
    run_check(SCRIPT, "check_scheduler_rules", ascend_tree, LLAMA)


def test_xlite_graph_mode_is_refused_at_start_up(ascend_tree: Path):
    """Finding 4: xlite computes attention outside vLLM's layers (zeros loaded)."""
    run_check(SCRIPT, "check_xlite_refused", ascend_tree)


def test_dry_run_of_the_start_up_on_vllm_ascend(ascend_tree: Path):
    """Acceptance: Llama, Qwen2.5, Qwen3, Qwen3-MoE (vllm-ascend's patched attention
    forward, finding 2) and the tiny DeepSeek (Ascend MLA) are accepted; Qwen3 with
    an M-RoPE is refused naming AscendMRotaryEmbedding."""
    out = run_check(SCRIPT, "check_dry_run", ascend_tree, str(models_dir()))
    assert "qwen3-mrope refused" in out


def test_deepseek_on_ascend_mla_allocates_its_latent_load_buffers_in_register_kv_caches(
        ascend_tree: Path):
    """Finding 10, on vllm-ascend's AscendMLAImpl and rope (npu_plugin_checks.py).
    Against the code before 98e9514 (reinstated one part at a time): the lazy allocation
    fails with `AssertionError: {}` (no buffer after register_kv_caches); the K/V sizing
    of load_scratch_bytes with `AssertionError: (29360128, 132120576)` (allocated vs
    counted); the per-layer MLA load with `a load took tensors of its own`."""
    run_check(SCRIPT, "check_deepseek_load_buffers_allocated_in_register_kv_caches",
              ascend_tree, str(models_dir()))


def test_deepseek_on_ascend_mla_forms_a_steps_cos_sin_once_per_frequencies(
        ascend_tree: Path):
    """Finding 8, on the with_pairing copies vllm-ascend's MLA reader makes of its
    AscendDeepseekScalingRotaryEmbedding (npu_plugin_checks.py). Against the code
    before 98e9514 (the step's cos/sin keyed by id(rotation), its cos_sin_rows):
    `AssertionError: ['cos_sin_rows', 'cos_sin_rows', 'cos_sin_rows']` (one per layer);
    with today's cos_sin_rows (host deltas), `a device value was read back on the host`.
    NOTE: the old code read back only on a device other than CPU and CUDA; on these CPU
    tensors the old code fails by its per-layer formation (docs/ascend.md)."""
    run_check(SCRIPT, "check_deepseek_load_step_forms_cos_sin_once_per_frequencies",
              ascend_tree, str(models_dir()))
