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
    question_aware,
    question_chunks,
    top_fraction,
)
from quality_eval.prompts import EncodedQuestion, ends_word  # noqa: E402
from vllm.v1.core.chunk_structures import ChunkedPrompt  # noqa: E402

from tests.chunk_isolation_mask import build_isolated_sequence  # noqa: E402

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
    assert (
        sum(q.kind == "single" for q in qs)
        == sum(q.kind == "two-hop" for q in qs)
        == 120
    )
    assert len({q.qid for q in qs}) == len(qs)
    for q in qs:
        assert len(q.documents) == 4 and len(set(q.documents)) == 4
        assert "##" not in "".join(
            q.segments
        )  # the separator never occurs in a segment
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
            assert [i for i, d in enumerate(q.documents) if name in d] == list(
                q.gold_documents
            )
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
# is the test oracle tests/chunk_isolation_mask.py (not in the wheel), tested in
# tests/unit/v1/core/test_chunk_isolation_mask.py;
# benchmarks/ only adds CacheBlend's selection.


def test_levers_reexport_the_overlay_reference():
    from quality_eval import levers

    from tests import chunk_isolation_mask as overlay

    for name in ("Role", "LeverSequence", "build_lever_sequence", "first_k"):
        assert getattr(levers, name) is getattr(overlay, name)
    lever = build_lever_sequence(PROMPT, "sink", first_k(PROMPT, 2), sink_token_id=SINK)
    assert lever.num_recomputed == 6 and lever.roles.count(Role.ISOLATED) == 6
    boundary = build_isolated_sequence(
        PROMPT, "sink", sink_token_id=SINK, recompute_tokens=2
    )
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
        "isolated",
        "cached",
        "cached",
        "recomputed",
    ]  # chunk 1 recomputes 14 only


def test_context_scale_bias_touches_only_question_rows_toward_real_chunk_tokens():
    import math

    seq = build_isolated_sequence(
        PROMPT, "sink", extra_token_ids=[30], sink_token_id=SINK
    )
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


# ------------------------------------------------ question-aware recompute (issue 33)


def test_question_aware_takes_the_most_attended_chunk_tokens():
    # One score per final token; system [0, 2) and question [11, 13) never compete,
    # however much attention they get.
    attention = torch.zeros(13)
    attention[[0, 1, 11, 12]] = 50.0
    attention[[3, 6, 9, 10]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    assert question_aware(PROMPT, attention, 0.0) == [[], [], []]
    assert question_aware(PROMPT, attention, 1 / 9) == [[1], [], []]
    assert question_aware(PROMPT, attention, 3 / 9) == [[1], [1], [0]]
    assert question_aware(PROMPT, attention, 1.0) == first_k(PROMPT, 100)
    # The recompute set's size is round(r * chunk tokens), across all chunks.
    for r in (0.05, 0.1, 0.15, 0.2, 0.5):
        picked = question_aware(PROMPT, attention, r)
        assert sum(map(len, picked)) == round(r * 9), r


def test_question_aware_first_tokens_count_inside_the_budget():
    attention = torch.zeros(13)
    attention[[4, 8, 9]] = torch.tensor([3.0, 2.0, 1.0])
    # first=1 forces each chunk's token 0 (3 tokens); the budget 5/9 leaves 2 to the
    # ranking: the two most attended non-forced tokens (4 -> chunk 0 index 2, 8 -> chunk
    # 1 index 3).
    assert question_aware(PROMPT, attention, 5 / 9, first=1) == [[0, 2], [0, 3], [0]]
    # A budget below the forced tokens grows to them (every chunk keeps its first).
    assert question_aware(PROMPT, attention, 1 / 9, first=1) == [[0], [0], [0]]
    # Chunks shorter than `first` are recomputed whole, no index past their end.
    assert question_aware(PROMPT, attention, 0.0, first=3) == first_k(PROMPT, 3)


def test_question_chunks_spends_the_budget_on_the_most_attended_chunks_heads():
    attention = torch.zeros(13)
    attention[[0, 11]] = 99.0  # system / question: not a chunk
    attention[[9, 10]] = 5.0  # chunk 2: mass 10
    attention[5] = 3.0  # chunk 1: mass 3; chunk 0: 0
    assert question_chunks(PROMPT, attention, 0.0) == [[], [], []]
    # 5 tokens: chunk 2 whole (2), then chunk 1's first 3.
    assert question_chunks(PROMPT, attention, 5 / 9) == [[], [0, 1, 2], [0, 1]]
    assert question_chunks(PROMPT, attention, 1.0) == first_k(PROMPT, 100)
    for r in (0.1, 0.2, 0.5):
        assert sum(map(len, question_chunks(PROMPT, attention, r))) == round(r * 9)


# The reference on a tiny real model: the ranking pass's attention, and the lever's
# ends.


@pytest.fixture(scope="module")
def tiny_scorer():
    from quality_eval.prompts import encode
    from quality_eval.reference import ReferenceScorer
    from transformers import AutoTokenizer

    from tests.conftest import models_dir

    path = str(models_dir() / "tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    scorer = ReferenceScorer(path, tokenizer.bos_token_id)
    return scorer, path, encode(tokenizer, build_dataset().questions[1])


def test_question_attention_is_hf_eager_attention_of_the_question_rows(tiny_scorer):
    """Oracle: transformers' own `output_attentions` of an eager model over the same
    isolated sequence, summed over layers, heads and the question's rows."""
    from transformers import AutoModelForCausalLM

    scorer, path, item = tiny_scorer
    prompt = item.prompt
    got = scorer.question_attention(prompt, "sink")
    eager = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    seq = build_isolated_sequence(prompt, "sink", sink_token_id=scorer.sink_token_id)
    with torch.inference_mode():
        out = eager(
            input_ids=torch.tensor([seq.token_ids]),
            position_ids=seq.position_ids[None],
            attention_mask=seq.additive_mask(),
            output_attentions=True,
        )
    q = prompt.question_span
    rows = (seq.source_index >= q.start) & (seq.source_index < q.end)
    per_key = torch.stack([a[0][:, rows].sum(dim=(0, 1)) for a in out.attentions]).sum(
        0
    )
    real = seq.real_rows
    assert torch.allclose(got[seq.source_index[real]], per_key[real], atol=1e-4)
    # Probabilities: each (layer, head, question row) gives 1 in all, to real tokens
    # only (the private sink copies are invisible to the question).
    config = eager.config
    expected = config.num_hidden_layers * config.num_attention_heads * q.num_tokens
    assert float(got.sum()) == pytest.approx(expected, rel=1e-5)
    assert float(per_key[seq.source_index < 0].abs().sum()) == 0.0
    # The reference's model is back on SDPA after the eager ranking pass.
    assert scorer.model.config._attn_implementation == "sdpa"


def test_question_aware_lever_ends_are_sink_and_full(tiny_scorer):
    """R = 0 recomputes nothing (= the `sink` mode) and r = 100% every chunk token
    (= full causal attention), through the reference's own lever mechanism."""
    from quality_eval.reference import LeverGrid

    scorer, _, item = tiny_scorer
    grid = LeverGrid(
        modes=("sink",),
        boundary_k=(),
        fractions=(),
        question_fractions=(0.0, 0.1, 1.0),
        question_first=(0, 2),
        question_chunk_fractions=(0.0, 1.0),
    )
    scores = scorer.evaluate(item, ("sink",), grid)
    chunk_tokens = item.num_chunk_tokens
    assert scores["sink+qa0"].recomputed == 0
    assert scores["sink+qa0"].gold_logprob == pytest.approx(
        scores["sink"].gold_logprob, abs=1e-4
    )
    assert scores["sink+qa100"].recomputed == chunk_tokens
    assert scores["sink+qa100"].gold_logprob == pytest.approx(
        scores["full"].gold_logprob, abs=1e-4
    )
    assert scores["sink+qa10"].recomputed == round(0.1 * chunk_tokens)
    assert scores["sink+qchunk0"].gold_logprob == pytest.approx(
        scores["sink"].gold_logprob, abs=1e-4
    )
    assert scores["sink+qchunk100"].gold_logprob == pytest.approx(
        scores["full"].gold_logprob, abs=1e-4
    )
    # first=2 with r=0: each chunk's first two tokens and nothing else.
    assert scores["sink+qa0+first2"].recomputed == 2 * item.prompt.num_chunks


def test_merge_reference_joins_levers_per_question_and_refuses_mismatches(tmp_path):
    import json

    from eval_quality import merge_reference

    def score(lp, recomputed=0):
        return {
            "gold_logprob": lp,
            "exact": False,
            "recomputed": recomputed,
            "chunk_tokens": 10,
        }

    mine = [{"qid": "s000", "scores": {"full": score(-1.0, 10), "sink": score(-2.0)}}]
    other = tmp_path / "other"
    other.mkdir()
    row = {
        "qid": "s000",
        "scores": {"sink": score(-2.0), "sink+qchunk10": score(-1.5, 1)},
    }
    (other / "reference.jsonl").write_text(json.dumps(row) + "\n")
    merged = merge_reference(mine, (str(other),))
    assert list(merged[0]["scores"]) == ["full", "sink", "sink+qchunk10"]
    assert "sink+qchunk10" not in mine[0]["scores"]  # the input rows are not modified
    row["scores"]["sink"] = score(-2.1)  # another model or question set
    (other / "reference.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(SystemExit, match="s000 sink differs"):
        merge_reference(mine, (str(other),))
    with pytest.raises(SystemExit, match="no row for t001"):
        merge_reference([{"qid": "t001", "scores": {}}], (str(other),))


def test_paired_table_differences_and_gap_interval():
    from quality_eval.report import paired_table

    def score(lp):
        return {"gold_logprob": lp, "exact": False, "recomputed": 0, "chunk_tokens": 10}

    # `half` closes exactly half of every question's gap: its interval is 50% to 50%.
    rows = [
        {
            "qid": q,
            "scores": {
                "full": score(-1.0 - d),
                "sink": score(-3.0 - d),
                "half": score(-2.0 - d),
            },
        }
        for q, d in (("a", 0), ("b", 1))
    ]
    lines = paired_table(rows, boot=50).splitlines()
    assert lines[2] == "| full | +2.000 +- 0.000 | - |"
    assert lines[3] == "| half | +1.000 +- 0.000 | 50% to 50% |"
