# SPDX-License-Identifier: Apache-2.0
"""A request computed as several query runs: positions and attention rows.

Truth: the runs' real positions written out by hand, and vLLM's own
`CommonAttentionMetadata` (the attention backends build from it).
"""

import numpy as np
import pytest
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.worker.query_runs import position_offsets, run_rows, split_rows

# Batch: "a" decodes (1 token at 40), "b" runs heads [5,7) and [13,15) and the
# question [19,22) (num_computed_tokens 15 after its loads: 15 + 7 = 22),
# "c" a plain prefill of 4 tokens after 10.
REQ_IDS = ["a", "b", "c"]
NUM_SCHEDULED = np.array([1, 7, 4])
NUM_COMPUTED = np.array([40, 15, 10])
RUNS = {"b": ((5, 2), (13, 2), (19, 3))}


def test_offsets_move_earlier_runs_back_to_their_positions():
    offsets = position_offsets(RUNS, REQ_IDS, NUM_SCHEDULED, NUM_COMPUTED)
    naive = np.concatenate(
        [np.arange(n, n + s) for n, s in zip(NUM_COMPUTED, NUM_SCHEDULED)]
    )
    assert (naive + offsets).tolist() == [40, 5, 6, 13, 14, 19, 20, 21, 10, 11, 12, 13]
    assert position_offsets(None, REQ_IDS, NUM_SCHEDULED, NUM_COMPUTED) is None
    assert (
        position_offsets({"gone": ((0, 1),)}, REQ_IDS, NUM_SCHEDULED, NUM_COMPUTED)
        is None
    )


def test_runs_that_do_not_end_at_the_sequence_end_are_refused():
    with pytest.raises(ValueError, match="last query run ends at 21"):
        position_offsets(
            {"b": ((5, 2), (13, 2), (18, 3))}, REQ_IDS, NUM_SCHEDULED, NUM_COMPUTED
        )
    with pytest.raises(ValueError, match="do not cover"):
        position_offsets({"b": ((5, 2), (19, 3))}, REQ_IDS, NUM_SCHEDULED, NUM_COMPUTED)


def _common() -> CommonAttentionMetadata:
    qsl = torch.tensor([0, 1, 8, 12], dtype=torch.int32)
    seq_lens = torch.tensor([41, 22, 14], dtype=torch.int32)
    table = torch.tensor([[7, 0], [3, 4], [9, 0]], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        num_reqs=3,
        num_actual_tokens=12,
        max_query_len=7,
        max_seq_len=41,
        block_table_tensor=table,
        slot_mapping=torch.arange(12),
        is_prefilling=torch.tensor([False, True, True]),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )


def test_each_run_is_a_row_over_its_request_block_table():
    rows = run_rows(RUNS, REQ_IDS, NUM_SCHEDULED, NUM_COMPUTED + NUM_SCHEDULED)
    assert rows.request_index.tolist() == [0, 1, 1, 1, 2]
    split = split_rows(_common(), rows)
    assert split.num_reqs == 5 and split.num_actual_tokens == 12
    assert split.query_start_loc.tolist() == [0, 1, 3, 5, 8, 12]
    assert split.query_start_loc_cpu.tolist() == [0, 1, 3, 5, 8, 12]
    # Each run's queries are the last tokens of its keys.
    assert split.seq_lens.tolist() == [41, 7, 15, 22, 14]
    assert split.seq_lens_cpu_upper_bound.tolist() == [41, 7, 15, 22, 14]
    assert split.block_table_tensor.tolist() == [[7, 0], [3, 4], [3, 4], [3, 4], [9, 0]]
    assert split.is_prefilling.tolist() == [False, True, True, True, True]
    assert (split.max_query_len, split.max_seq_len) == (4, 41)
    # Token-level fields are untouched.
    assert split.slot_mapping.tolist() == list(range(12))


def test_padded_rows_are_refused():
    rows = run_rows(
        RUNS, REQ_IDS[:2], NUM_SCHEDULED[:2], (NUM_COMPUTED + NUM_SCHEDULED)[:2]
    )
    with pytest.raises(ValueError, match="unpadded"):
        split_rows(_common(), rows)
