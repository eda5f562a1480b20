"""The pure parts of benchmarks/eval_quality.py (no engine, no eval run): the QA
set's determinism and content, and the structure of the recompute-lever masks."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from quality_eval.dataset import DatasetConfig, build_dataset  # noqa: E402
from quality_eval.levers import (  # noqa: E402
    Role,
    build_lever_sequence,
    context_scale_bias,
    first_k,
    top_fraction,
)
from quality_eval.prompts import EncodedQuestion, ends_word  # noqa: E402

from vllm.v1.core.chunk_isolation_mask import build_isolated_sequence  # noqa: E402
from vllm.v1.core.chunk_structures import ChunkedPrompt  # noqa: E402

SINK = 7
# system [10 11], chunks [12 13 14] [15 16 17 18] [19 20], question [21 22]
PROMPT = ChunkedPrompt.from_lengths(list(range(10, 23)), [2, 3, 4, 2, 2])


def as_rows(allowed: torch.Tensor) -> list[str]:
    return ["".join("1" if x else "." for x in row) for row in allowed[0, 0].tolist()]


# ---------------------------------------------------------------- dataset


def test_dataset_is_deterministic_and_seeded():
    a, b = build_dataset(), build_dataset()
    assert a == b
    assert build_dataset(DatasetConfig(seed=1)).questions != a.questions


def test_dataset_shape():
    data = build_dataset()
    qs = data.questions
    assert len(qs) >= 200
    assert sum(q.kind == "single" for q in qs) == sum(q.kind == "two-hop" for q in qs) == 120
    assert len({q.qid for q in qs}) == len(qs)
    for q in qs:
        assert len(q.documents) == 4 and len(set(q.documents)) == 4
        assert "##" not in "".join(q.segments)  # the separator never occurs in a segment
        assert len(q.gold_documents) == (1 if q.kind == "single" else 2)
        # The answer is stated in a gold document.
        assert any(q.answer in q.documents[i] for i in q.gold_documents)


def test_each_question_needs_its_gold_documents():
    data = build_dataset()
    people = {p.name: p for p in data.people}
    orgs = {o.name: o for o in data.organisations}
    for q in data.questions:
        if q.kind == "single" and q.attribute != "year":
            # The person asked about is named in the gold document only.
            name = next(n for n in people if n in q.question)
            assert [i for i, d in enumerate(q.documents) if name in d] == list(q.gold_documents)
        elif q.kind == "two-hop":
            org = next(o for o in orgs.values() if o.name in q.question)
            leader = people[org.leader]
            # The question names the organisation, not the person: one document
            # gives the leader, the other the leader's fact.
            assert leader.name not in q.question
            org_doc = q.documents.index(org.document())
            person_doc = q.documents.index(leader.document())
            assert sorted([org_doc, person_doc]) == list(q.gold_documents)
            assert q.answer == getattr(leader, q.attribute)


def test_encoded_question_ids():
    item = EncodedQuestion(build_dataset().questions[0], ((1, 2), (3,), (4, 5)), (6,))
    assert item.plain_ids() == [1, 2, 3, 4, 5]
    assert item.chunked_ids([99], (6,)) == [1, 2, 99, 3, 99, 4, 5, 6]
    assert item.prompt.segment_lengths == (2, 1, 2)
    assert item.num_chunk_tokens == 1
    assert ends_word(".") and ends_word("\n") and ends_word("") and ends_word(" and")
    assert not ends_word("5") and not ends_word("ra") and not ends_word("'s")


# ----------------------------------------------------------------- levers
# The lever reference itself (build_lever_sequence, first_k, the boundary lever)
# is part of the overlay and tested in tests/unit/v1/core/test_chunk_isolation_mask.py;
# benchmarks/ only adds CacheBlend's selection.


def test_levers_reexport_the_overlay_reference():
    from quality_eval import levers
    from vllm.v1.core import chunk_isolation_mask as overlay

    for name in ("Role", "LeverSequence", "build_lever_sequence", "first_k"):
        assert getattr(levers, name) is getattr(overlay, name)
    lever = build_lever_sequence(PROMPT, "sink", first_k(PROMPT, 2), sink_token_id=SINK)
    assert lever.num_recomputed == 6 and lever.roles.count(Role.ISOLATED) == 6
    boundary = build_isolated_sequence(PROMPT, "sink", sink_token_id=SINK, recompute_tokens=2)
    assert lever.seq.token_ids == boundary.token_ids
    assert torch.equal(lever.seq.allowed, boundary.allowed)


def test_top_fraction():
    scores = torch.zeros(13)
    scores[[0, 1, 11, 12]] = 100.0  # system and question tokens never compete
    scores[[4, 8, 10]] = torch.tensor([3.0, 2.0, 1.0])
    assert top_fraction(PROMPT, scores, 2 / 9) == [[2], [3], []]
    assert top_fraction(PROMPT, scores, 3 / 9) == [[2], [3], [1]]
    assert top_fraction(PROMPT, scores, 0.0) == [[], [], []]
    assert top_fraction(PROMPT, scores, 1.0) == first_k(PROMPT, 100)
    # A CacheBlend selection is a valid lever (non-contiguous recomputed tokens).
    lever = build_lever_sequence(PROMPT, "none", top_fraction(PROMPT, scores, 3 / 9))
    assert [r.value for r in lever.roles[2:6]] == [
        "isolated", "cached", "cached", "recomputed"]  # chunk 1 recomputes 14 only


def test_context_scale_bias_touches_only_question_rows_toward_real_chunk_tokens():
    import math

    seq = build_isolated_sequence(PROMPT, "sink", extra_token_ids=[30], sink_token_id=SINK)
    bias = context_scale_bias(PROMPT, seq, 2.0)
    src = seq.source_index.tolist()
    for q, row in enumerate(bias.tolist()):
        for k, value in enumerate(row):
            toward_chunk = src[k] >= 2 and src[k] < 11  # real chunk tokens [2, 11)
            expected = math.log(2.0) if src[q] >= 11 and toward_chunk else 0.0
            assert value == pytest.approx(expected, abs=1e-6), (q, k)
    # The private sink copies are never real: no bias toward them.
    copies = [k for k, s in enumerate(src) if s < 0]
    assert copies and not bias[:, copies].any()
