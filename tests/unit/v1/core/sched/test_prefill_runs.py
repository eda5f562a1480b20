# SPDX-License-Identifier: Apache-2.0
"""Several computed stretches of one prompt in one step: what the scheduler takes."""

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import PrefillGap
from vllm.v1.core.sched.prefill_runs import PrefillRuns


def gap(*stretches: tuple[int, int]) -> PrefillGap:
    (loaded, computed), *rest = stretches
    return PrefillGap(
        loaded, computed, next_stretches=tuple(PrefillGap(*s) for s in rest)
    )


def test_one_stretch_is_the_single_gap_rule():
    # No next stretches: load 5, compute min(rest, max_new_tokens).
    runs = PrefillRuns.of_gap(0, gap((5, 2)), num_left=22)
    assert (runs.num_external_tokens, runs.num_new_tokens) == (5, 2)
    assert runs.query_runs() == ((5, 2),) and not runs.is_split
    # The question: what is left of the prompt caps it.
    assert PrefillRuns.of_gap(19, gap((0, 3)), num_left=3).num_new_tokens == 3


def test_every_head_and_the_question_become_runs_at_their_positions():
    # system [0,5), chunk [5,13), chunk [13,19), question [19,22); K = 2.
    runs = PrefillRuns.of_gap(0, gap((5, 2), (6, 2), (4, 3)), num_left=22)
    assert (runs.num_external_tokens, runs.num_new_tokens) == (15, 7)
    assert runs.query_runs() == ((5, 2), (13, 2), (19, 3))
    assert runs.is_split


def test_a_budget_cut_keeps_the_loads_before_the_last_computed_token_only():
    runs = PrefillRuns.of_gap(0, gap((5, 2), (6, 2), (4, 3)), num_left=22)
    # 3 tokens: the first head and one token of the second; the last rest waits.
    cut = runs.truncated(3)
    assert cut.stretches == ((5, 2), (6, 1))
    assert (cut.num_external_tokens, cut.num_new_tokens) == (11, 3)
    assert cut.query_runs() == ((5, 2), (13, 1))
    # Exactly the first head: the next rest is not loaded before its head.
    assert runs.truncated(2).stretches == ((5, 2),)
    assert not runs.truncated(2).is_split
    # Nothing fits (the scheduler skips the request): the first load stays.
    assert runs.truncated(0).stretches == ((5, 0),)
    assert runs.truncated(7) == runs
    with pytest.raises(ValueError):
        runs.truncated(-1)


def test_a_step_that_starts_inside_a_head_finishes_it_first():
    # Position 6: one token of the first head left, then the rest as before.
    runs = PrefillRuns.of_gap(6, gap((0, 1), (6, 2), (4, 3)), num_left=16)
    assert runs.query_runs() == ((6, 1), (13, 2), (19, 3))
    assert runs.num_new_tokens + runs.num_external_tokens == 22 - 6


def _budget(mode_name: str, max_num_seqs: int, capture: int):
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.core.sched.prefill_runs import RunRowBudget

    return RunRowBudget.of_config(
        SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
            compilation_config=SimpleNamespace(
                cudagraph_mode=CUDAGraphMode[mode_name],
                max_cudagraph_capture_size=capture,
            ),
        )
    )


def test_at_most_runs_keeps_the_first_runs_and_no_load_after_them():
    runs = PrefillRuns.of_gap(0, gap((5, 2), (6, 2), (4, 3)), num_left=22)
    two = runs.at_most_runs(2)
    assert two.query_runs() == ((5, 2), (13, 2))
    assert (two.num_external_tokens, two.num_new_tokens) == (
        11,
        4,
    )  # not the 4 before 19
    one = runs.at_most_runs(1)
    assert one.query_runs() == ((5, 2),) and not one.is_split
    assert runs.at_most_runs(3) == runs == runs.at_most_runs(9)
    with pytest.raises(ValueError, match="max_runs"):
        runs.at_most_runs(0)


def test_under_full_graphs_a_step_rows_fit_the_fixed_attention_buffer():
    """Issue 60: FlashAttention 3 keeps its scheduler metadata for max(max_num_seqs,
    largest capture size) rows under full-graph modes (4 here); every request of the
    step takes one, the runs the rest, in scheduling order."""
    budget = _budget("FULL_AND_PIECEWISE", max_num_seqs=4, capture=2)
    assert budget.max_rows == 4
    heads = PrefillRuns.of_gap(0, gap((5, 2), (6, 2), (4, 3)), num_left=22)  # 3 runs
    budget.start_step(num_requests=2)  # 2 rows left for runs beyond one per request
    first = budget.take(heads)
    assert first == heads and budget.extra_left == 0
    second = budget.take(PrefillRuns.of_gap(100, gap((5, 2), (6, 2), (4, 3)), 22))
    assert second.query_runs() == ((105, 2),)  # its other runs wait for a later step
    # 2 requests + 2 extra rows = 4: the buffer holds the step.
    assert 2 + len(first.query_runs()) - 1 + len(second.query_runs()) - 1 <= 4
    # A step with as many requests as max_num_seqs has no room for runs at all.
    budget.start_step(num_requests=9)
    assert budget.take(heads).query_runs() == ((5, 2),)


def test_without_full_graphs_runs_are_not_capped():
    for mode in ("NONE", "PIECEWISE"):
        budget = _budget(mode, max_num_seqs=1, capture=1)
        budget.start_step(num_requests=1)
        heads = PrefillRuns.of_gap(0, gap(*[(5, 2)] * 40), num_left=300)
        assert budget.max_rows is None and budget.take(heads) == heads
    assert _budget("FULL_DECODE_ONLY", 8, 16).max_rows == 16
