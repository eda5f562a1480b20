"""The recompute-lever masks of benchmarks/quality_levers.py: structure only (no model)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from vllm.v1.core.chunk_isolation_mask import build_isolated_sequence
from vllm.v1.core.chunk_structures import ChunkedPrompt

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "quality_levers.py"
_spec = importlib.util.spec_from_file_location("quality_levers", _PATH)
levers = importlib.util.module_from_spec(_spec)
sys.modules["quality_levers"] = levers  # dataclasses look their module up by name
_spec.loader.exec_module(levers)

SINK = 1
MODES = ["none", "sink", "system"]


def prompt() -> ChunkedPrompt:
    # system 3, chunks 4 and 5, question 2 tokens.
    ids = list(range(100, 114))
    return ChunkedPrompt.from_lengths(ids, [3, 4, 5, 2])


def same(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert torch.equal(a.position_ids, b.position_ids)
    assert torch.equal(a.allowed, b.allowed)
    assert torch.equal(a.source_index, b.source_index)


@pytest.mark.parametrize("mode", MODES)
def test_no_recompute_is_the_plain_isolation_mask(mode):
    p = prompt()
    for rc in (levers.Recompute.none(p), levers.first_k(p, 0)):
        got = levers.build_lever_sequence(p, mode, rc, extra_token_ids=[7, 8],
                                          sink_token_id=SINK)
        same(got, build_isolated_sequence(p, mode, extra_token_ids=[7, 8],
                                          sink_token_id=SINK))


@pytest.mark.parametrize("mode", MODES)
def test_recomputing_everything_is_causal_over_the_real_tokens(mode):
    p = prompt()
    seq = levers.build_lever_sequence(p, mode, levers.all_tokens(p), extra_token_ids=[7],
                                      sink_token_id=SINK)
    rows = seq.real_rows
    assert [seq.token_ids[r] for r in rows.tolist()] == p.token_ids + [7]
    assert torch.equal(seq.position_ids[rows], torch.arange(len(p.token_ids) + 1))
    real = seq.allowed[0, 0][rows][:, rows]
    assert torch.equal(real, torch.ones_like(real).tril())
    # Nothing real attends to a private copy (only the copies themselves do).
    copies = seq.source_index < 0
    assert not seq.allowed[0, 0][rows][:, copies].any()


def test_first_k_keeps_isolated_copies_for_the_cached_rest():
    p = prompt()
    seq = levers.build_lever_sequence(p, "sink", levers.first_k(p, 2), sink_token_id=SINK)
    allowed = seq.allowed[0, 0]
    src, pos = seq.source_index, seq.position_ids
    # Chunk 1 spans positions 3..6: the real token at position 5 (cached) sees the sink
    # copy and the isolated copies of positions 3, 4, never their recomputed versions.
    cached = int(torch.nonzero(src == 5))
    seen = torch.nonzero(allowed[cached]).flatten().tolist()
    assert [(int(pos[i]), int(src[i])) for i in seen] == [(2, -1), (3, -1), (4, -1), (5, 5)]
    # The recomputed real token at position 4 sees the system, itself and position 3.
    recomputed = int(torch.nonzero(src == 4))
    seen = torch.nonzero(allowed[recomputed]).flatten().tolist()
    assert sorted(int(src[i]) for i in seen) == [0, 1, 2, 3, 4]
    # Chunk 2 (positions 7..11): its first real token is recomputed and sees chunk 1.
    first = int(torch.nonzero(src == 7))
    assert sorted(int(src[i]) for i in torch.nonzero(allowed[first]).flatten()) == list(range(8))
    # The question (positions 12, 13) sees every real token and no copy.
    q = int(torch.nonzero(src == 13))
    assert sorted(int(src[i]) for i in torch.nonzero(allowed[q]).flatten()) == list(range(14))
    assert seq.token_ids[-2:] == p.token_ids[-2:]


def test_selections_count_and_order():
    p = prompt()
    assert levers.first_k(p, 16).offsets == ((0, 1, 2, 3), (0, 1, 2, 3, 4))
    dev = torch.zeros(14)
    dev[[4, 9, 10]] = torch.tensor([3.0, 2.0, 1.0])
    # 9 chunk tokens: 30% -> 3 tokens, the largest deviations.
    assert levers.top_deviation(p, dev, 0.3).offsets == ((1,), (2, 3))
    r = levers.random_fraction(p, 0.3, seed=0)
    assert r.num_tokens() == 3 and r == levers.random_fraction(p, 0.3, seed=0)
    with pytest.raises(ValueError):
        levers.build_lever_sequence(p, "none", levers.Recompute(((9,), ())))
