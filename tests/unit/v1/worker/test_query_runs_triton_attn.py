# SPDX-License-Identifier: Apache-2.0
"""Issue 40, deliverable 3 (first part): what TRITON_ATTN would do with a step whose
request is split into query runs (the boundary recompute in one step), checked on the
CPU.

* The metadata: `split_rows` on vLLM's `CommonAttentionMetadata`, then the installed
  vLLM's own `TritonAttentionMetadataBuilder.build` (either base, 0.23 or 0.32: the
  builder's attributes are those of both, the metadata's fields are read by name), gives
  per row the query starts, sequence lengths and block-table row written out by hand
  below (the builder passes them through).
* The kernel: vLLM's Triton `unified_attention`, run by Triton's interpreter
  (TRITON_INTERPRET=1) on those rows over a paged cache, against a float64 softmax
  written here: a token at position p of any run attends to every key at positions 0..p
  of its request (the system, earlier heads, loaded rests, earlier tokens of its own
  run), never a later one; a request without runs is a plain row.

Float32 only (the interpreter's bfloat16 run of this kernel gives garbage). The one-step
path is still offered on the CPU backend only (`RecomputeSteps.for_config`);
this is the evidence a CUDA port would start from. Not executed on a GPU.
"""

import dataclasses
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton compiles anything

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.worker.query_runs import run_rows, split_rows

triton_attn = pytest.importorskip("vllm.v1.attention.backends.triton_attn")


def _vllm_triton_modules(*names: str):
    """VLLM's kernel modules executed afresh, in order, with the real `triton` in place
    of the placeholder vLLM binds without a GPU driver (as
    tests/unit/vllm_triton_cache_write.py; the source is vLLM's, unchanged); a later
    module imports the fresh earlier ones. The process's own modules are put back
    afterwards."""
    import importlib.util
    import sys

    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils

    saved = triton_utils.triton, triton_utils.tl
    saved_modules = {name: sys.modules.get(name) for name in names}
    triton_utils.triton, triton_utils.tl = triton, tl
    fresh = []
    try:
        for name in names:
            module = importlib.util.module_from_spec(importlib.util.find_spec(name))
            sys.modules[name] = module
            module.__spec__.loader.exec_module(module)
            fresh.append(module)
    finally:
        triton_utils.triton, triton_utils.tl = saved
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return fresh


_, unified = _vllm_triton_modules(
    "vllm.v1.attention.ops.triton_attention_helpers",
    "vllm.v1.attention.ops.triton_unified_attention",
)

BLOCK, HEAD, Q_HEADS, KV_HEADS = 16, 32, 4, 2
# "a": a plain prefill of 3 tokens after 6 cached (no runs); "b": heads [5,7) and
# [17,19) with loaded rests between them, then the question [30,33): 7 tokens in one
# step, num_computed_tokens 26 (every load counted), sequence 33.
REQ_IDS = ["a", "b"]
NUM_SCHEDULED = np.array([3, 7])
SEQ_LENS = np.array([9, 33])
RUNS = {"b": ((5, 2), (17, 2), (30, 3))}
TABLE = torch.tensor([[6, 0, 0], [2, 5, 1]], dtype=torch.int32)  # b's 33 keys: 3 blocks


def _split() -> CommonAttentionMetadata:
    qsl = torch.tensor([0, 3, 10], dtype=torch.int32)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        num_reqs=2,
        num_actual_tokens=10,
        max_query_len=7,
        max_seq_len=33,
        block_table_tensor=TABLE.clone(),
        slot_mapping=torch.arange(10),
        is_prefilling=torch.tensor([True, True]),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    return split_rows(common, run_rows(RUNS, REQ_IDS, NUM_SCHEDULED, SEQ_LENS))


def _bare_builder(cls, **state):
    """`cls` without its __init__ (it needs a model config, layers and GPU buffers),
    with the attributes its `build` reads set to `state`: what __init__ sets on a
    machine without CUDA graphs, AOT scheduling, DCP, R-SWA, multimodal prefixes or
    SM120. `state` names the attributes of both vLLM bases (0.23 and 0.32); one a base's
    build does not read is unused there, and one a newer build reads that is not here
    fails loudly (AttributeError) rather than being guessed."""
    builder = object.__new__(cls)
    builder.__dict__.update(device=torch.device("cpu"), **state)
    return builder


def _triton_metadata(split):
    # vLLM's own build; the 3D (segmented softmax) launch is off (no threshold, no
    # scratch), so the kernel below takes the 2D path over exactly these rows.
    builder = _bare_builder(
        triton_attn.TritonAttentionMetadataBuilder,
        seq_threshold_3D=None,
        num_par_softmax_segments=None,
        softmax_segm_output=None,
        softmax_segm_max=None,
        softmax_segm_expsum=None,
        max_seqs_64_segments=0,  # 0.32: the 64-segment layout is SM120 only
        rswa_window=None,
        persistent_rswa_prefix_lens=None,
    )  # 0.32: R-SWA off
    return builder.build(0, split)


def _field_names(meta) -> set[str]:
    return {f.name for f in dataclasses.fields(meta)}


def _assert_plain_causal(meta):
    """No cascade (a field 0.23's metadata has, 0.32's dropped) and causal rows (a field
    0.32's TRITON_ATTN metadata has; 0.23's kernel is causal only)."""
    names = _field_names(meta)
    if "use_cascade" in names:
        assert not meta.use_cascade
    if "causal" in names:
        assert meta.causal is True


def test_triton_attn_gets_one_row_per_run_over_the_request_block_table():
    meta = _triton_metadata(_split())
    # Worked by hand: a = 3 queries ending at 9; b's runs 2, 2, 3 queries ending at 7,
    # 19, 33.
    assert meta.query_start_loc.tolist() == [0, 3, 5, 7, 10]
    assert meta.seq_lens.tolist() == [9, 7, 19, 33]
    assert meta.block_table.tolist() == [[6, 0, 0], [2, 5, 1], [2, 5, 1], [2, 5, 1]]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_actual_tokens) == (3, 33, 10)
    _assert_plain_causal(meta)


def test_flash_attn_gets_the_same_rows():
    """FLASH_ATTN (the installed vLLM's builder; AOT scheduling, DCP, full CUDA graphs,
    R-SWA and multimodal prefixes off, as they cannot be set up without a GPU): the same
    rows as TRITON_ATTN. With FA3's AOT
    scheduling on a GPU, `get_scheduler_metadata` is handed these same rows (not
    executed here)."""
    flash = pytest.importorskip("vllm.v1.attention.backends.flash_attn")
    builder = _bare_builder(
        flash.FlashAttentionMetadataBuilder,
        aot_schedule=False,
        aot_sliding_window=(-1, -1),
        use_full_cuda_graph=False,
        max_cudagraph_size=None,
        max_num_splits=0,
        dcp_world_size=1,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        kv_cache_dtype=torch.bfloat16,
        # 0.32: R-SWA and the multimodal-prefix staging buffers off
        rswa_window=None,
        persistent_rswa_prefix_lens=None,
        persistent_rswa_window_tensor=None,
        mm_prefix_query_ranges_cpu=None,
        mm_prefix_query_ranges_np=None,
        mm_prefix_query_ranges_gpu=None,
    )
    meta = builder.build(0, _split())
    assert meta.query_start_loc.tolist() == [0, 3, 5, 7, 10]
    assert meta.seq_lens.tolist() == [9, 7, 19, 33]
    assert meta.block_table.tolist() == [[6, 0, 0], [2, 5, 1], [2, 5, 1], [2, 5, 1]]
    assert (meta.max_query_len, meta.max_seq_len, meta.causal) == (3, 33, True)
    assert meta.scheduler_metadata is None
    _assert_plain_causal(meta)


def _positions() -> list[tuple[int, int]]:
    """(request index, position) of each query token, in batch order."""
    out = [(0, p) for p in range(6, 9)]
    for p, n in RUNS["b"]:
        out += [(1, q) for q in range(p, p + n)]
    return out


def _attend(meta, dtype, window: int | None = None):
    """VLLM's kernel over `meta`'s rows; `window`: a sliding window of that many keys,
    passed as vLLM's TritonAttentionImpl passes a layer's (`(window - 1, 0)`)."""
    gen = torch.Generator().manual_seed(40)
    num_blocks = 8
    key_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD, generator=gen).to(
        dtype
    )
    query = torch.randn(10, Q_HEADS, HEAD, generator=gen).to(dtype)
    out = torch.full_like(query, float("nan"))
    unified.unified_attention(
        q=query,
        k=key_cache,
        v=value_cache,
        out=out,
        cu_seqlens_q=meta.query_start_loc,
        max_seqlen_q=meta.max_query_len,
        seqused_k=meta.seq_lens,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=HEAD**-0.5,
        causal=True,
        window_size=(-1, -1) if window is None else (window - 1, 0),
        block_table=meta.block_table,
        softcap=0,
        q_descale=None,
        k_descale=None,
        v_descale=None,
    )
    return key_cache, value_cache, query, out


def _oracle(key_cache, value_cache, query, window: int | None = None) -> torch.Tensor:
    """Float64 attention of each query token over its request's keys 0..position (with
    `window`: only keys k with position - k < window, HF's rule and the windowed
    isolation semantics', docs/design/sliding-window.md), gathered through the request's
    block-table row by hand."""
    group = Q_HEADS // KV_HEADS
    want = torch.empty(query.shape, dtype=torch.float64)
    for t, (req, pos) in enumerate(_positions()):
        first = 0 if window is None else max(0, pos - window + 1)
        slots = torch.arange(first, pos + 1)
        blocks = TABLE[req][slots // BLOCK].long()
        k = key_cache[blocks, slots % BLOCK].double()  # [keys, kv heads, head]
        v = value_cache[blocks, slots % BLOCK].double()
        for h in range(Q_HEADS):
            w = torch.softmax(
                k[:, h // group] @ query[t, h].double() * HEAD**-0.5, dim=0
            )
            want[t, h] = w @ v[:, h // group]
    return want


# NOTE: float32 only: under Triton 3.6's interpreter the same launch in bfloat16 gave
# values of ~1e8 (garbage, not rounding; not investigated). The kernel's arithmetic per
# dtype is the GPU's business; what is checked here is which keys each row sees.

_KERNEL_TESTS = (
    "test_triton_unified_attention_over_the_runs_is_causal_over_the_real_positions",
    "test_without_the_split_the_heads_would_see_the_wrong_keys",
    "test_a_sliding_window_applies_by_real_position_over_the_runs",
)


@functools.cache
def _fresh_process_output() -> str:
    """Both kernel tests in one new pytest process, Triton imported under
    TRITON_INTERPRET=1 there: its output."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:randomly",
            *(f"{__file__}::{name}" for name in _KERNEL_TESTS),
        ],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.stdout + proc.stderr


def _ran_in_a_fresh_process(test: str) -> bool:
    """Run this file's kernel tests in a new pytest process where Triton is imported
    under TRITON_INTERPRET=1, unless this process's Triton already interprets; `test`
    must have passed there.

    NOTE: in the whole suite another module imports vLLM (hence Triton) first, before
    this file sets TRITON_INTERPRET; Triton's own `tl` helpers (e.g. `tl.zeros`) are
    then compiled-mode functions the interpreter cannot call (RuntimeError "Cannot call
    @triton.jit'd outside of the scope of a kernel"). The tests themselves are
    unchanged. One process runs both (a start of vLLM's imports costs ~25 s on 2
    cores)."""
    import triton.language as tl

    if type(tl.zeros).__name__ != "JITFunction":
        return False
    out = _fresh_process_output()
    assert re.search(rf"^PASSED \S*{Path(__file__).name}::{test}\s*$", out, re.M), out[
        -6000:
    ]
    return True


def test_triton_unified_attention_over_the_runs_is_causal_over_the_real_positions():
    if _ran_in_a_fresh_process(
        "test_triton_unified_attention_over_the_runs_is_causal_over_the_real_positions"
    ):
        return
    key_cache, value_cache, query, out = _attend(
        _triton_metadata(_split()), torch.float32
    )
    want = _oracle(key_cache, value_cache, query)
    assert not torch.isnan(out).any()  # every query token of every run was written
    assert torch.allclose(out.double(), want, atol=1e-5, rtol=1e-5)


def test_without_the_split_the_heads_would_see_the_wrong_keys():
    """The oracle tells the rows apart: b as one row of 7 queries ending at 33 puts its
    heads at positions 26..29 (the question's 30..32 stay right)."""
    if _ran_in_a_fresh_process(
        "test_without_the_split_the_heads_would_see_the_wrong_keys"
    ):
        return
    unsplit = _triton_metadata(
        CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, 3, 10], dtype=torch.int32),
            query_start_loc_cpu=torch.tensor([0, 3, 10], dtype=torch.int32),
            seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32),
            num_reqs=2,
            num_actual_tokens=10,
            max_query_len=7,
            max_seq_len=33,
            block_table_tensor=TABLE.clone(),
            slot_mapping=torch.arange(10),
        )
    )
    key_cache, value_cache, query, out = _attend(unsplit, torch.float32)
    want = _oracle(key_cache, value_cache, query)
    close = [
        torch.allclose(out[t].double(), want[t], atol=1e-5, rtol=1e-5)
        for t in range(10)
    ]
    assert close == [True] * 3 + [False] * 4 + [True] * 3


WINDOW = 4


def test_a_sliding_window_applies_by_real_position_over_the_runs():
    """Issue 52 (item 4): a windowed layer on TRITON_ATTN. Each row's query tokens see
    only the keys within the window of their real position: a's 6..8 and b's heads at
    5..6 and 17..18 and its question at 30..32 each attend to keys (p - 4, p], loaded
    rests and earlier runs included, through the request's block table. The windowed
    oracle tells the window apart: without it every token at a position >= 4 would see
    more keys."""
    if _ran_in_a_fresh_process(
        "test_a_sliding_window_applies_by_real_position_over_the_runs"
    ):
        return
    key_cache, value_cache, query, out = _attend(
        _triton_metadata(_split()), torch.float32, window=WINDOW
    )
    want = _oracle(key_cache, value_cache, query, window=WINDOW)
    assert not torch.isnan(out).any()
    assert torch.allclose(out.double(), want, atol=1e-5, rtol=1e-5)
    full = _oracle(key_cache, value_cache, query)
    assert not any(
        torch.allclose(out[t].double(), full[t], atol=1e-5, rtol=1e-5)
        for t, (_, pos) in enumerate(_positions())
        if pos >= WINDOW
    )
