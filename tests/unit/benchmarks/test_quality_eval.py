"""The pure parts of benchmarks/eval_quality.py (no engine, no eval run): the QA
set's determinism and content, and the structure of the recompute-lever masks."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from quality_eval.dataset import DatasetConfig, build_dataset  # noqa: E402
from quality_eval.levers import Role, build_lever_sequence, first_k, top_fraction  # noqa: E402
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


@pytest.mark.parametrize("mode", ["none", "sink", "system"])
def test_no_recompute_is_the_isolation_mask(mode):
    lever = build_lever_sequence(PROMPT, mode, [[], [], []], extra_token_ids=[30, 31],
                                 sink_token_id=SINK)
    ref = build_isolated_sequence(PROMPT, mode, extra_token_ids=[30, 31], sink_token_id=SINK)
    assert lever.seq.token_ids == ref.token_ids
    assert torch.equal(lever.seq.position_ids, ref.position_ids)
    assert torch.equal(lever.seq.allowed, ref.allowed)
    assert torch.equal(lever.seq.source_index, ref.source_index)
    assert lever.num_recomputed == 0


@pytest.mark.parametrize("mode", ["none", "sink", "system"])
def test_full_recompute_is_causal_attention(mode):
    lever = build_lever_sequence(PROMPT, mode, first_k(PROMPT, 100), extra_token_ids=[30],
                                 sink_token_id=SINK)
    seq = lever.seq
    real = seq.real_rows
    assert [seq.token_ids[i] for i in real] == PROMPT.token_ids + [30]
    assert seq.position_ids[real].tolist() == list(range(len(PROMPT.token_ids) + 1))
    sub = seq.allowed[0, 0][real][:, real]
    assert torch.equal(sub, torch.ones_like(sub).tril())
    # No real token sees a private copy.
    assert not seq.allowed[0, 0][real][:, seq.source_index < 0].any()
    assert lever.num_recomputed == 9


def test_partial_recompute_hand_worked():
    # Sink mode; chunk 1 recomputes its 2nd token (13), chunk 3 its 2nd (20).
    lever = build_lever_sequence(PROMPT, "sink", [[1], [], [1]], sink_token_id=SINK)
    assert [r.value for r in lever.roles] == [
        "system", "system",
        "context", "isolated", "cached", "recomputed", "cached",
        "context", "cached", "cached", "cached", "cached",
        "context", "isolated", "cached", "recomputed",
        "open", "open"]
    assert lever.seq.token_ids == [10, 11, 7, 13, 12, 13, 14, 7, 15, 16, 17, 18, 7, 20, 19,
                                   20, 21, 22]
    assert lever.seq.position_ids.tolist() == [0, 1, 1, 3, 2, 3, 4, 4, 5, 6, 7, 8, 8, 10, 9,
                                               10, 11, 12]
    assert as_rows(lever.seq.allowed) == [
        "1.................",
        "11................",
        "..1...............",  # sink
        "..111.............",  # isolated copy of 13: sink, 12, itself
        "..1.1.............",  # 12 (cached): sink, itself
        "11..11............",  # 13 recomputed: the system, 12, itself - no copies
        "..111.1...........",  # 14 (cached): sink, the *isolated* 13, 12, itself
        ".......1..........",
        ".......11.........",
        ".......111........",
        ".......1111.......",
        ".......11111......",
        "............1.....",
        "............111...",
        "............1.1...",
        "11..111.1111..11..",  # 20 recomputed: every real token before it
        "11..111.1111..111.",  # question: every real token
        "11..111.1111..1111",
    ]


def test_lever_argument_errors():
    with pytest.raises(ValueError, match="recompute sets"):
        build_lever_sequence(PROMPT, "none", [[], []])
    with pytest.raises(ValueError, match="out of range"):
        build_lever_sequence(PROMPT, "none", [[], [], [2]])
    with pytest.raises(ValueError, match="sink"):
        build_lever_sequence(PROMPT, "sink", [[], [], []])


def test_selection_helpers():
    assert first_k(PROMPT, 3) == [[0, 1, 2], [0, 1, 2], [0, 1]]
    assert first_k(PROMPT, 0) == [[], [], []]
    scores = torch.zeros(13)
    scores[[0, 1, 11, 12]] = 100.0  # system and question tokens never compete
    scores[[4, 8, 10]] = torch.tensor([3.0, 2.0, 1.0])
    assert top_fraction(PROMPT, scores, 2 / 9) == [[2], [3], []]
    assert top_fraction(PROMPT, scores, 3 / 9) == [[2], [3], [1]]
    assert top_fraction(PROMPT, scores, 0.0) == [[], [], []]
    assert top_fraction(PROMPT, scores, 1.0) == first_k(PROMPT, 100)


@torch.inference_mode()
def test_levers_on_a_tiny_model():
    """Numerically: no recompute gives the mode's outputs, full recompute gives
    plain causal attention's (a random 2-layer Llama, no engine)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager")).eval()

    def run(seq):
        logits = model(input_ids=torch.tensor([seq.token_ids]),
                       position_ids=seq.position_ids[None],
                       attention_mask=seq.additive_mask(torch.float32)).logits[0]
        return logits[seq.real_rows]

    causal = model(input_ids=torch.tensor([PROMPT.token_ids])).logits[0]
    full = run(build_lever_sequence(PROMPT, "sink", first_k(PROMPT, 100), sink_token_id=SINK).seq)
    torch.testing.assert_close(full, causal, atol=1e-5, rtol=1e-5)
    none = run(build_lever_sequence(PROMPT, "sink", first_k(PROMPT, 0), sink_token_id=SINK).seq)
    iso = run(build_isolated_sequence(PROMPT, "sink", sink_token_id=SINK))
    torch.testing.assert_close(none, iso)
    assert not torch.allclose(none[-1], causal[-1], atol=1e-3)  # isolation matters here
