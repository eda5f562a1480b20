# SPDX-License-Identifier: Apache-2.0
"""The workers' load buffers and a step's cos/sin, per model kind (issue 30 finding 5,
issue 29 findings 8 and 10), and the one owner of the capture-path decision (issue 30
"Also"), without an engine."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import (
    fused_chunk_load_path,
    setup,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
    LatentWriter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
    ChunkCacheMetadata,
    RequestLoad,
    SegmentStretch,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.mla_latent_layers import (
    LatentLayer,
)
from vllm.v1.worker.position_remapper import RemapScratch, RopeRotation

from tests.unit.ascend.step_probes import cos_sin_formed_without_host_reads
from tests.unit.distributed.test_chunk_cache_worker import _sizing_config, _worker

RANK, ROPE = 48, 16


def test_the_load_buffers_are_sized_for_the_model_kind_and_the_layers_that_take_them(
    monkeypatch,
):
    """Before: 4096 rows of K, V, rotated K and two fp32 K copies of the whole KV width,
    for every model: an MLA model (whose loads took none of them) and a model whose
    every layer loads through the fused kernel (which takes none) alike."""
    cfg = _sizing_config()  # 3 KV heads x 64, bf16, --max-chunk-load-tokens 4096
    standard = 4096 * (3 * 192 * 2 + 2 * 192 * 4)
    assert setup.load_scratch_bytes(cfg) == standard
    # MLA: one latent row (kv_c 512 + k_pe 64), kv_c and k_pe in bf16, k_pe's rotation
    # through two fp32 rows and back.
    cfg.model_config.use_mla = True
    cfg.model_config.hf_text_config = SimpleNamespace(qk_rope_head_dim=64)
    cfg.model_config.get_head_size = lambda: 576
    cfg.model_config.get_num_kv_heads = lambda parallel_config: 1
    assert setup.load_scratch_bytes(cfg) == 4096 * (
        512 * 2 + 64 * 2 + 2 * 64 * 4 + 64 * 2
    )
    # Every layer expected on the fused kernel: only the fallback's rows.
    cfg = _sizing_config()
    monkeypatch.setattr(
        fused_chunk_load_path, "fused_load_expected", lambda config: True
    )
    assert setup.load_scratch_rows(cfg) == setup.FALLBACK_SCRATCH_ROWS
    assert (
        setup.load_scratch_bytes(cfg) == standard * setup.FALLBACK_SCRATCH_ROWS // 4096
    )


def test_the_fused_kernel_is_expected_only_on_cuda(monkeypatch):
    """The config-time guess the buffers are sized from: never on this CPU."""
    cfg = _sizing_config()
    cfg.attention_config = SimpleNamespace(backend=None)
    assert fused_chunk_load_path.fused_load_expected(cfg) is False


class _Rope(torch.nn.Module):
    """DeepSeek-style k_pe rope (GPT-J pairs), vLLM's default rule."""


def _latent_worker(vllm_config_context, num_layers=2):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rope = get_rope(ROPE, 4096, False, {"rope_type": "default"}, torch.float32)
    rotation = RopeRotation(rope, use_cpu_kernel=False)
    writes = []

    def write(layer, kv_c, k_pe, slots, cache):
        writes.append((kv_c, k_pe))
        flat = cache.view(-1, RANK + ROPE)
        flat[slots] = torch.cat((kv_c, k_pe), dim=-1)

    def read(cache, slots):
        return cache.view(-1, RANK + ROPE).index_select(0, slots)

    # The writer fixes k_pe's pairing (as Ascend's): each layer keeps its own copy of
    # the rotation (`with_pairing`), with the rope's frequencies.
    writer = LatentWriter("TEST", write, read, k_pe_neox_style=True)
    worker = _worker()
    worker.device = torch.device("cpu")
    scratch = worker._scratch
    layer = SimpleNamespace(kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    for i in range(num_layers):
        cache = torch.zeros(8, 16, RANK + ROPE)
        worker.latent[f"l{i}"] = LatentLayer.of(
            f"l{i}", layer, cache, rotation, writer, 64, torch.float32, scratch
        )
        worker.latent[f"l{i}"].pool.normal_()
    return worker, writes


def _meta():
    return ChunkCacheMetadata(
        loads=[
            RequestLoad(
                block_ids=(2, 3),
                stretches=(
                    SegmentStretch(
                        (0, 1), first_row=0, num_rows=20, dst_position=3, delta=500
                    ),
                    SegmentStretch(
                        (2,), first_row=2, num_rows=7, dst_position=23, delta=-3
                    ),
                ),
            )
        ]
    )


def test_mla_loads_take_the_shared_load_buffers(vllm_config_context):
    """Issue 29 finding 10. Before: every MLA layer gathered, split and rotated its rows
    into new tensors per step (and `.contiguous()` copies), while the buffers the carve
    counted went unused. Now kv_c and k_pe reach the backend's write in the worker's
    buffers, the same ones for every layer."""
    worker, writes = _latent_worker(vllm_config_context)
    worker._allocate_scratch()
    scratch = worker._scratch
    assert sorted(role for role, *_ in scratch._buffers) == sorted(
        ["kv_c", "k_pe", "k_pe_rotated"]
    )  # fp32 pool: no fp32 copies
    worker.start_load_kv(_meta(), SimpleNamespace())
    buffers = {b.data_ptr() for b in scratch._buffers.values()}
    assert len(writes) == 2
    for kv_c, k_pe in writes:
        assert kv_c.is_contiguous() and k_pe.is_contiguous()
        assert {kv_c.data_ptr(), k_pe.data_ptr()} <= buffers


def test_a_step_reads_nothing_back_and_forms_cos_sin_once_per_frequencies(
    vllm_config_context,
):
    """Issue 29 finding 8. Before: every MLA layer's rotation (its own `with_pairing`
    copy) missed the step's cos/sin, keyed by the rope object, and formed its own (on an
    NPU through `deltas.cpu()`, a host synchronisation per layer). Now the step forms
    the cos/sin of each stretch once per set of frequencies, on the host from the
    metadata's integers, and reads no device value back."""
    worker, writes = _latent_worker(vllm_config_context, num_layers=3)
    with cos_sin_formed_without_host_reads() as formed:
        worker.start_load_kv(_meta(), SimpleNamespace())
    assert len(writes) == 3
    assert formed == ["cos_sin"], formed


def test_the_config_time_capture_decision_is_the_per_layer_decision():
    """Issue 30 "Also": one owner (capture_path) decides where captures run. The config
    (the CUDA-graph mode, before any layer exists) says some layer captures in the hook
    exactly where the per-layer decision (`choose_capture`, its self-check with vLLM's
    own Triton cache write into a FlashAttention cache) sends the layer there; an
    unquantized cache, which that write and read give back bit for bit, is never
    predicted as a hook."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import capture_path

    from tests.unit.distributed.test_chunk_cache_capture_path import (
        _flash_layer,
        _flash_writer,
    )

    for cache_dtype in ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"):
        cfg = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype))
        layer, kv_cache = _flash_layer("NHD", torch.bfloat16)
        layer.impl.kv_cache_dtype = cache_dtype
        choice = capture_path.choose_capture(
            {"l0": layer}, {"l0": kv_cache}, {"l0": _flash_writer()}, torch.bfloat16
        )
        config_says_hook = capture_path.capture_hook_reason(cfg) is not None
        assert config_says_hook is ("l0" in choice.in_attention), (cache_dtype, choice)


def test_prepared_buffers_are_the_ones_taken():
    scratch = RemapScratch(8)
    scratch.prepare(
        RemapScratch.STANDARD,
        {"k": (2, 4), "v": (2, 4)},
        torch.bfloat16,
        torch.device("cpu"),
    )
    assert scratch.nbytes() == 8 * RemapScratch.bytes_per_row(8, 8, torch.bfloat16)
    before = dict(scratch._buffers)
    like = torch.zeros(3, 2, 4, dtype=torch.bfloat16)
    scratch.take("key", like, 5)
    scratch.take("key32", like, 5, torch.float32)
    assert scratch._buffers == before
