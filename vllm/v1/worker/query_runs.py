# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A request computed as several query runs in one step (model runner side).

For a request with `SchedulerOutput.query_runs` ((first position, length) of
each run), its earlier runs' positions are moved back to their real ones
(`position_offsets`) and its attention row becomes one row per run over the
same block-table row, `seq_len` = the run's end (`split_rows`).
Why: docs/design/boundary-recompute.md, "Why one step".
"""

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from vllm.v1.core.sched.prefill_runs import QueryRun
from vllm.v1.worker.host_staging import HostStaging

# Per-row fields of CommonAttentionMetadata a split row copies from its request.
_COPIED_PER_ROW = ("block_table_tensor", "is_prefilling", "req_idx", "causal")
# Per-row fields with no meaning for a split row: refused when set.
_REFUSED_PER_ROW = (
    "encoder_seq_lens",
    "dcp_local_seq_lens",
    "rswa_prefix_lens",
    "replayssm_decode_base_cpu",
    "mm_req_doc_ranges",
)


@dataclass(frozen=True)
class RunRows:
    """A step's attention rows (host): request index, query and sequence length."""

    request_index: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.request_index)


def _runs_by_index(
    query_runs: dict[str, tuple[QueryRun, ...]],
    req_ids: list[str],
    num_scheduled: np.ndarray,
) -> dict[int, tuple[QueryRun, ...]]:
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


def position_offsets(
    query_runs: dict[str, tuple[QueryRun, ...]] | None,
    req_ids: list[str],
    num_scheduled: np.ndarray,
    num_computed: np.ndarray,
) -> np.ndarray | None:
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
        offsets[starts[i] : starts[i] + len(real)] = real - naive
    return offsets


def run_rows(
    query_runs: dict[str, tuple[QueryRun, ...]],
    req_ids: list[str],
    num_scheduled: np.ndarray,
    seq_lens: np.ndarray,
) -> RunRows:
    """One row per run of a request with runs, one per other request."""
    by_index = _runs_by_index(query_runs, req_ids, num_scheduled)
    rows: list[tuple[int, int, int]] = []  # (request index, query, sequence)
    for i in range(len(req_ids)):
        runs = by_index.get(i)
        if runs is None:
            rows.append((i, int(num_scheduled[i]), int(seq_lens[i])))
        else:
            rows.extend((i, n, p + n) for p, n in runs)
    index, qlens, slens = np.asarray(rows, dtype=np.int64).reshape(-1, 3).T
    return RunRows(
        np.ascontiguousarray(index), qlens.astype(np.int32), slens.astype(np.int32)
    )


def check_runs_dispatch(rows: RunRows | None, cudagraph_mode: Any) -> None:
    """Refuse a step with query runs dispatched to a full CUDA graph, which
    replays the rows it was captured with, not the runs' (a raise, not an
    assert: it must hold under python -O)."""
    if rows is None or cudagraph_mode is None:
        return
    from vllm.config.compilation import CUDAGraphMode

    if cudagraph_mode == CUDAGraphMode.FULL:
        raise RuntimeError(
            f"a step with query runs ({rows.num_rows} attention rows for "
            f"{int(rows.request_index.max()) + 1} requests) was dispatched to "
            f"cudagraph runtime mode {cudagraph_mode.name}: a full CUDA graph "
            "replays the rows it was captured with, not the runs'; "
            "--chunk-recompute-tokens in one step needs a --compilation-config "
            "cudagraph_mode whose mixed batches run piecewise or eagerly "
            "(FULL_AND_PIECEWISE, PIECEWISE, FULL_DECODE_ONLY, NONE), or "
            "CHUNK_CACHE_RECOMPUTE_ONE_STEP=0"
        )


def split_rows(common: Any, rows: RunRows, staging: HostStaging | None = None) -> Any:
    """`common` (a CommonAttentionMetadata with one row per request, no
    padding) with one row per run. `staging`: the runner's host buffers for
    the rows' device copies (a fresh one, unpinned on the CPU, if None)."""
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
    if staging is None:
        staging = HostStaging(device)
    index = torch.from_numpy(rows.request_index)
    qsl_cpu = torch.zeros(rows.num_rows + 1, dtype=common.query_start_loc_cpu.dtype)
    qsl_cpu[1:] = torch.from_numpy(np.cumsum(rows.query_lens))
    seq_lens_cpu = torch.from_numpy(rows.seq_lens).to(common.seq_lens.dtype)
    changes: dict[str, Any] = dict(
        query_start_loc=staging.to_device("query_start_loc", qsl_cpu),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=staging.to_device("seq_lens", seq_lens_cpu),
        num_reqs=rows.num_rows,
        max_query_len=int(rows.query_lens.max()),
        max_seq_len=int(rows.seq_lens.max()),
    )
    index_on = {device: staging.to_device("request_index", index)}
    for name in _COPIED_PER_ROW:
        value = getattr(common, name, None) if name in names else None
        if isinstance(value, torch.Tensor):
            if value.device not in index_on:
                index_on[value.device] = index.to(value.device)
            changes[name] = value[index_on[value.device]]
        elif isinstance(value, np.ndarray):
            changes[name] = value[rows.request_index]
    query_lens_cpu = torch.from_numpy(rows.query_lens).to(seq_lens_cpu.dtype)
    host_copies = {
        "seq_lens_cpu_upper_bound": seq_lens_cpu,
        "_seq_lens_cpu": seq_lens_cpu,
        "_num_computed_tokens_cpu": seq_lens_cpu - query_lens_cpu,
    }
    for name, value in host_copies.items():
        if name in names and getattr(common, name) is not None:
            changes[name] = value
    for cache in ("_num_computed_tokens_cache", "_token_to_req_indices_cache"):
        if cache in names:
            changes[cache] = None
    return replace(common, **changes)
