# SPDX-License-Identifier: Apache-2.0
"""Several computed stretches of one prompt in one step: what the scheduler takes."""

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.base import PrefillGap
from vllm.v1.core.sched.prefill_runs import PrefillRuns


def gap(*stretches: tuple[int, int]) -> PrefillGap:
    (loaded, computed), *rest = stretches
    return PrefillGap(loaded, computed, next_stretches=tuple(PrefillGap(*s) for s in rest))


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
