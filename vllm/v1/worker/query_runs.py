# SPDX-License-Identifier: Apache-2.0
"""A request computed as several query runs in one step (model runner side).

`SchedulerOutput.query_runs` lists, for a request whose scheduled tokens are
several stretches of its prompt with loaded KV between them (a KV connector's
prefill gaps, `vllm/v1/core/sched/prefill_runs.py`), the (first position,
length) of each run. Everything the model runner does per request stays per
request (input ids, sampling, the request's last token); two things change:

* positions (and so the slot mapping and the input ids gathered from them):
  the runner's `num_computed_tokens + arange` is right for the last run only
  (num_computed_tokens already counts every loaded stretch), earlier runs are
  moved back to their real positions (`position_offsets`);
* attention metadata: each run becomes its own row, over the same block
  table, with `seq_len = its last position + 1` (`split_rows`), because every
  attention backend takes a row's query tokens as the last tokens of its
  keys. A later run sees an earlier run's keys: each layer writes the step's
  K/V into the paged cache before its attention reads it.

vLLM 0.32's `CommonAttentionMetadata.req_idx` already lets several rows
share one request's KV (prefill context parallelism); the rows here use it.
"""

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch

QueryRun = tuple[int, int]

# Per-row fields of CommonAttentionMetadata that a split row copies from its
# request (0.23 and 0.32 names; a field a base lacks is skipped).
_COPIED_PER_ROW = ("block_table_tensor", "is_prefilling", "req_idx", "causal")
# Per-row fields with no meaning for a split row: refused when set.
_REFUSED_PER_ROW = (
    "encoder_seq_lens", "dcp_local_seq_lens", "rswa_prefix_lens",
    "replayssm_decode_base_cpu", "mm_req_doc_ranges",
)


@dataclass(frozen=True)
class RunRows:
    """The attention rows of one step: per row, its request's index in the
    batch, its query length and its sequence length (on the host)."""

    request_index: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.request_index)


def _runs_by_index(query_runs: dict[str, tuple[QueryRun, ...]], req_ids: list[str],
                   num_scheduled: np.ndarray) -> dict[int, tuple[QueryRun, ...]]:
    out = {}
    for i, rid in enumerate(req_ids):
        runs = query_runs.get(rid)
        if runs is None:
            continue
        if sum(n for _, n in runs) != int(num_scheduled[i]):
            raise ValueError(
                f"request {rid}: query runs {runs} do not cover its "
                f"{int(num_scheduled[i])} scheduled tokens"
            )
        out[i] = runs
    return out


def position_offsets(query_runs: dict[str, tuple[QueryRun, ...]] | None,
                     req_ids: list[str], num_scheduled: np.ndarray,
                     num_computed: np.ndarray) -> np.ndarray | None:
    """Real position minus the runner's position (`num_computed + i`) of
    every scheduled token, in batch order; None when no request has runs."""
    if not query_runs:
        return None
    by_index = _runs_by_index(query_runs, req_ids, num_scheduled)
    if not by_index:
        return None
    offsets = np.zeros(int(num_scheduled.sum()), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(num_scheduled)[:-1]])
    for i, runs in by_index.items():
        real = np.concatenate([np.arange(p, p + n) for p, n in runs])
        first = int(num_computed[i])
        naive = np.arange(first, first + len(real))
        if real[-1] != naive[-1]:
            raise ValueError(
                f"request {req_ids[i]}: its last query run ends at {real[-1] + 1}, "
                f"not at its sequence length {naive[-1] + 1}"
            )
        offsets[starts[i]:starts[i] + len(real)] = real - naive
    return offsets


def run_rows(query_runs: dict[str, tuple[QueryRun, ...]], req_ids: list[str],
             num_scheduled: np.ndarray, seq_lens: np.ndarray) -> RunRows:
    """One row per run of a request with runs, one per other request."""
    by_index = _runs_by_index(query_runs, req_ids, num_scheduled)
    index, qlens, slens = [], [], []
    for i in range(len(req_ids)):
        runs = by_index.get(i)
        if runs is None:
            index.append(i)
            qlens.append(int(num_scheduled[i]))
            slens.append(int(seq_lens[i]))
            continue
        for p, n in runs:
            index.append(i)
            qlens.append(n)
            slens.append(p + n)
    return RunRows(np.asarray(index, dtype=np.int64), np.asarray(qlens, dtype=np.int32),
                   np.asarray(slens, dtype=np.int32))


def split_rows(common: Any, rows: RunRows) -> Any:
    """`common` (a CommonAttentionMetadata with one row per request, no
    padding) with one row per run."""
    names = {f.name for f in fields(common)}
    if common.num_reqs != int(rows.request_index.max()) + 1:
        raise ValueError(
            f"query runs need unpadded attention rows: {common.num_reqs} rows "
            f"for {int(rows.request_index.max()) + 1} requests"
        )
    for name in _REFUSED_PER_ROW:
        if name in names and getattr(common, name) is not None:
            raise ValueError(f"query runs are not supported with {name} set")
    device = common.query_start_loc.device
    index = torch.from_numpy(rows.request_index)
    qsl_cpu = torch.zeros(rows.num_rows + 1, dtype=common.query_start_loc_cpu.dtype)
    qsl_cpu[1:] = torch.from_numpy(np.cumsum(rows.query_lens))
    seq_lens_cpu = torch.from_numpy(rows.seq_lens).to(common.seq_lens.dtype)
    changes: dict[str, Any] = dict(
        query_start_loc=qsl_cpu.to(device),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens_cpu.to(device),
        num_reqs=rows.num_rows,
        max_query_len=int(rows.query_lens.max()),
        max_seq_len=int(rows.seq_lens.max()),
    )
    for name in _COPIED_PER_ROW:
        value = getattr(common, name, None) if name in names else None
        if isinstance(value, torch.Tensor):
            changes[name] = value[index.to(value.device)]
        elif isinstance(value, np.ndarray):
            changes[name] = value[rows.request_index]
    if "seq_lens_cpu_upper_bound" in names and common.seq_lens_cpu_upper_bound is not None:
        changes["seq_lens_cpu_upper_bound"] = seq_lens_cpu
    if "_seq_lens_cpu" in names and common._seq_lens_cpu is not None:
        changes["_seq_lens_cpu"] = seq_lens_cpu
    if "_num_computed_tokens_cpu" in names and common._num_computed_tokens_cpu is not None:
        changes["_num_computed_tokens_cpu"] = seq_lens_cpu - torch.from_numpy(
            rows.query_lens).to(seq_lens_cpu.dtype)
    for cache in ("_num_computed_tokens_cache", "_token_to_req_indices_cache"):
        if cache in names:
            changes[cache] = None
    return replace(common, **changes)
