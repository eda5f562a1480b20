"""The question set of benchmarks/quality_dataset.py: deterministic, and well formed."""

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "quality_dataset.py"
_spec = importlib.util.spec_from_file_location("quality_dataset", _PATH)
ds = importlib.util.module_from_spec(_spec)
sys.modules["quality_dataset"] = ds  # dataclasses look their module up by name
_spec.loader.exec_module(ds)


def test_same_seed_same_questions_other_seed_other_questions():
    a = ds.build_dataset(ds.DatasetConfig(seed=3))
    assert a == ds.build_dataset(ds.DatasetConfig(seed=3))
    assert a != ds.build_dataset(ds.DatasetConfig(seed=4))


def test_default_set_has_200_questions_of_both_kinds():
    qs = ds.build_dataset()
    assert len(qs) >= 200
    assert sum(q.kind == "single" for q in qs) == 100
    assert sum(q.kind == "two_hop" for q in qs) == 100


def test_gold_documents_hold_the_answer_and_distractors_do_not_answer():
    for q in ds.build_dataset(ds.DatasetConfig(num_single=30, num_two_hop=30, seed=1)):
        assert len(q.documents) == 6 and len(set(q.documents)) == 6
        assert len(q.gold) == (1 if q.kind == "single" else 2)
        assert q.answer in " ".join(q.documents[i] for i in q.gold)
        others = [d for i, d in enumerate(q.documents) if i not in q.gold]
        assert not any(q.answer in d for d in others) or q.kind == "single" and \
            q.answer in ds._CITIES  # cities repeat across people; the person does not
        assert ds.SEP not in "".join(q.documents + (q.question,))
        assert q.prompt.count(f" {ds.SEP} ") == len(q.documents) + 1


def test_two_hop_needs_both_documents():
    for q in ds.build_dataset(ds.DatasetConfig(num_single=0, num_two_hop=20)):
        lead, room = (q.documents[i] for i in q.gold)
        if "is led by" not in lead:
            lead, room = room, lead
        leader = lead.split(" is led by ")[1].split(".")[0]
        # The question names the project only; the room document names the leader only.
        assert leader not in q.question.split("assistant")[0]
        assert leader in room and q.answer in room and q.answer not in lead
