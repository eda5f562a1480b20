# SPDX-License-Identifier: Apache-2.0
"""Loaded and computed stretches of a chunked prompt under boundary recompute."""

import pytest
from vllm.v1.core.chunk_prefill_plan import PrefillPlan, PrefillStep
from vllm.v1.core.chunk_structures import ChunkedPrompt, SegmentSpan


def prompt(*lengths: int) -> ChunkedPrompt:
    return ChunkedPrompt.from_lengths(list(range(sum(lengths))), lengths)


def test_without_recompute_everything_before_the_question_is_one_stretch():
    plan = PrefillPlan.for_prompt(prompt(5, 8, 6, 3), 0)
    assert plan.loaded == (SegmentSpan(0, 19),)
    assert (plan.num_loaded, plan.num_recomputed, plan.num_steps) == (19, 0, 1)
    assert plan.step_at(0) == PrefillStep(num_loaded=19, max_computed=3)
    # vLLM's prefix cache already holds 16 tokens: load the other 3.
    assert plan.step_at(16) == PrefillStep(3, 3)
    assert plan.step_at(20) == PrefillStep(0, 2)


def test_recompute_splits_every_chunk_into_a_computed_head_and_a_loaded_rest():
    # system [0,5), chunk [5,13), chunk [13,19), question [19,22)
    plan = PrefillPlan.for_prompt(prompt(5, 8, 6, 3), 2)
    assert plan.loaded == (SegmentSpan(0, 5), SegmentSpan(7, 13), SegmentSpan(15, 19))
    assert (plan.num_loaded, plan.num_recomputed, plan.num_steps) == (15, 4, 3)
    # Walk the prefill as the scheduler does: load, compute, load, compute...
    walk, position = [], 0
    while position < plan.num_tokens:
        step = plan.step_at(position)
        walk.append((position, step.num_loaded, step.max_computed))
        position += step.num_loaded + step.max_computed
    assert walk == [(0, 5, 2), (7, 6, 2), (15, 4, 3)]
    # In the middle of a head (chunked prefill) or of a rest (prefix-cache hit).
    assert plan.step_at(6) == PrefillStep(0, 1)
    assert plan.step_at(10) == PrefillStep(3, 2)


def test_a_chunk_no_longer_than_k_is_recomputed_whole_and_heads_merge():
    # chunk 1 has 2 tokens <= K=3: computed whole, next to chunk 2's head.
    plan = PrefillPlan.for_prompt(prompt(4, 2, 7, 1), 3)
    assert plan.loaded == (SegmentSpan(0, 4), SegmentSpan(9, 13))
    assert plan.step_at(0) == PrefillStep(4, 5)
    assert plan.num_recomputed == 5


def test_rests_that_touch_are_one_stretch():
    plan = PrefillPlan.for_prompt(prompt(4, 5, 1), 0)
    assert plan.loaded == (SegmentSpan(0, 9),)


@pytest.mark.parametrize("position", [-1, 22])
def test_positions_outside_the_prompt_are_errors(position):
    with pytest.raises(ValueError, match="outside the prompt"):
        PrefillPlan.for_prompt(prompt(5, 8, 6, 3), 2).step_at(position)


def test_negative_k_is_an_error():
    with pytest.raises(ValueError, match=">= 0"):
        PrefillPlan.for_prompt(prompt(5, 8, 6, 3), -1)


def test_steps_from_walks_every_stretch_to_the_question_in_one_call():
    # system [0,5), chunk [5,13), chunk [13,19), question [19,22); K = 2.
    plan = PrefillPlan.for_prompt(prompt(5, 8, 6, 3), 2)
    assert plan.steps_from(0) == (
        PrefillStep(5, 2),
        PrefillStep(6, 2),
        PrefillStep(4, 3),
    )
    # From inside a head (a step budget cut it): finish it, then the rest.
    assert plan.steps_from(6) == (
        PrefillStep(0, 1),
        PrefillStep(6, 2),
        PrefillStep(4, 3),
    )
    assert plan.steps_from(20) == (PrefillStep(0, 2),)


def test_loaded_from_skips_the_computed_heads_between_loaded_stretches():
    plan = PrefillPlan.for_prompt(prompt(5, 8, 6, 3), 2)
    assert plan.loaded_from(0, 5) == (SegmentSpan(0, 5),)
    assert plan.loaded_from(0, 15) == (
        SegmentSpan(0, 5),
        SegmentSpan(7, 13),
        SegmentSpan(15, 19),
    )
    # A prefix-cache hit ending inside a rest; a budget that stops after a rest.
    assert plan.loaded_from(10, 7) == (SegmentSpan(10, 13), SegmentSpan(15, 19))
    assert plan.loaded_from(6, 6) == (SegmentSpan(7, 13),)
    with pytest.raises(ValueError, match="only 4 are loaded"):
        plan.loaded_from(15, 5)


def test_a_chunk_shorter_than_k_joins_the_computed_stretch_around_it():
    # system [0,3), chunk [3,5) (2 < K), chunk [5,12), question [12,14); K = 3.
    plan = PrefillPlan.for_prompt(prompt(3, 2, 7, 2), 3)
    assert plan.steps_from(0) == (PrefillStep(3, 5), PrefillStep(4, 2))
