"""The Ascend side without an NPU: the vllm-ascend series applied to the pinned sdist,
every patched or new vllm-ascend file compiled, and the fork's NPU code paths run on
CPU against a stub `torch_npu` (tests/unit/ascend/stubs: CPU reference implementations
of the two cache-write ops and MLA's fused norm-rope-cache write; they check our index
and layout math, not the NPU ops). Nothing here executes NPU code: docs/ascend.md lists
what never ran."""

from __future__ import annotations

import py_compile
from pathlib import Path

import pytest
from forktool.git import git

from tests.unit.ascend.ascend_checks import CheckOutcome, run_checks


def test_every_patched_or_new_file_compiles(ascend_tree: Path):
    changed = git(ascend_tree, "diff", "--name-only", "upstream", "HEAD").split()
    py_files = [f for f in changed if f.endswith(".py")]
    assert "vllm_ascend/worker/model_runner_v1.py" in py_files
    assert "vllm_ascend/distributed/chunk_cache_npu.py" in py_files
    for rel in py_files:
        py_compile.compile(str(ascend_tree / rel), doraise=True)


STUB_CHECKS = [
    "check_registration_covers_standard_attention_mla_and_sfa_only",
    "check_load_path_writes_rotated_rows_through_device_operator",
    "check_mla_load_writes_what_ascend_writes_at_the_new_position",
    "check_mla_reader_returns_what_the_writer_wrote",
    "check_mla_refusals",
    "check_ascend_ropes_registered_and_keys_move_as_at_the_new_position",
    "check_mla_load_with_ascend_deepseek_rope",
    "check_sfa_load_writes_what_ascend_writes_at_the_new_position",
    "check_sfa_reader_returns_what_the_writer_wrote",
    "check_sfa_li_c8_load_quantizes_as_ascend_at_the_new_position",
    "check_sfa_refusals",
]
STARTUP_CHECKS = [
    "check_hamming_sparse_refused",
    "check_pp_refused_on_npu",
    "check_fa_quant_and_pd_mix_refused",
    "check_carve_counts_the_npu_kv_alignment",
    "check_carve_counts_the_npu_kv_alignment_for_sfa",
    "check_capture_check_avoids_assert_async_on_npu",
    "check_mlapo_is_read_per_layer_after_weights_load",
    "check_full_graph_refusal_names_the_npu_not_a_quantized_cache",
    "check_sparse_mla_passes_the_config_on_the_npu_platform_only",
]


# NOTE: each script's checks run as one batch, each check in a process forked after
# the imports (check_batch.py): one import of vLLM and vllm-ascend per script, not per
# check (~20 s of CPU each).
@pytest.fixture(scope="module")
def stub_outcomes(ascend_tree: Path) -> dict[str, CheckOutcome]:
    return run_checks("npu_stub_checks.py", STUB_CHECKS, ascend_tree)


@pytest.fixture(scope="module")
def startup_outcomes(ascend_tree: Path) -> dict[str, CheckOutcome]:
    return run_checks("npu_startup_checks.py", STARTUP_CHECKS, ascend_tree)


@pytest.mark.parametrize("check", STUB_CHECKS)
def test_npu_code_path_against_stubs(
    stub_outcomes: dict[str, CheckOutcome], check: str
):
    stub_outcomes[check].assert_ok(check)


@pytest.mark.parametrize("check", STARTUP_CHECKS)
def test_npu_start_up_against_vllm_ascend(
    startup_outcomes: dict[str, CheckOutcome], check: str
):
    """Issue 29, findings 5, 6, 7, 9, 11: tests/unit/ascend/npu_startup_checks.py."""
    startup_outcomes[check].assert_ok(check)
