"""A stand-in for `torch_npu` on CPU: NOT Huawei's library.

Eight ops have CPU reference implementations written from their documented
semantics (SFA's indexer: `npu_scatter_nd_update_`, `npu_rotary_mul` "half" mode,
`npu_dynamic_quant` per row): the two cache writes (the paged caches are [num_blocks,
block_size, num_kv_heads, head_size]; token i goes to block slot //
block_size, offset slot % block_size; key and value widths may differ, as
for MLA's latent and rope caches), `_npu_rotary_embedding` (as vLLM's
`rotary_embedding` op, whose signature it shares) and MLA's fused
`npu_kv_rmsnorm_rope_cache` ("PA" mode only), and `npu_format_cast` to the
plain ND format (the identity). Every other attribute exists
so that vllm-ascend's modules import, and raises NotImplementedError when
called. Tests backed by this stub check the fork's index and layout math on
Ascend's code path, not the NPU ops themselves.
"""

from __future__ import annotations

import sys
import types

import torch


class _NoStub:
    """Any torch_npu attribute without a CPU reference: importable, not callable."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"torch_npu.{self._name} has no CPU stub")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _NoStub(f"{self._name}.{name}")

    # Used in annotations such as `torch.npu.Stream | None`.
    def __or__(self, other):
        return self

    def __ror__(self, other):
        return self

    def __mro_entries__(self, bases):
        return (object,)


class _Namespace(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _NoStub(f"{self.__name__}.{name}")


def _scatter(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    block_size = cache.shape[1]
    slots = slots.to(torch.int64)
    cache[slots // block_size, slots % block_size] = rows.to(cache.dtype)


def _npu_reshape_and_cache(*, key, value, key_cache, value_cache, slot_indices):
    """A2/A3: write key/value rows [n, heads, dim] at `slot_indices` [n]."""
    _scatter(key, key_cache, slot_indices)
    _scatter(value, value_cache, slot_indices)


def npu_scatter_pa_kv_cache(
    *, key, value, key_cache, value_cache, slot_mapping, cache_mode="Norm"
):
    """A5: the same write ("Norm" layout only)."""
    if cache_mode != "Norm":
        raise NotImplementedError(f"cache_mode={cache_mode!r} has no CPU stub")
    _scatter(key, key_cache, slot_mapping)
    _scatter(value, value_cache, slot_mapping)


def npu_kv_rmsnorm_rope_cache(
    kv,
    gamma,
    cos,
    sin,
    index,
    k_cache,
    ckv_cache,
    *,
    k_rope_scale=None,
    c_kv_scale=None,
    k_rope_offset=None,
    c_kv_offset=None,
    epsilon=1e-5,
    cache_mode="Norm",
    is_output_kv=False,
):
    """MLA, "PA" mode: kv [n, 1, 1, rank + rope] -> RMSNorm(kv[..., :rank]) * gamma
    into ckv_cache and the interleaved rope of kv[..., rank:] (evens then odds,
    rotated neox-style with cos/sin [n, 1, 1, rope]) into k_cache, at slots
    `index` [n]. Returns (k_cache, ckv_cache, k_pe, kv_c); the last two only
    with is_output_kv (as the op's documented outputs)."""
    if cache_mode != "PA" or c_kv_scale is not None or k_rope_scale is not None:
        raise NotImplementedError(f"cache_mode={cache_mode!r} / quantized: no CPU stub")
    rank = ckv_cache.shape[-1]
    x = kv.float()
    c = x[..., :rank]
    kv_c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + epsilon) * gamma.float()
    r = x[..., rank:]
    x1, x2 = r[..., 0::2], r[..., 1::2]
    k_pe = (
        torch.cat((x1, x2), -1) * cos.float() + torch.cat((-x2, x1), -1) * sin.float()
    )
    n = kv.shape[0]
    kv_c = kv_c.reshape(n, 1, rank).to(kv.dtype)
    k_pe = k_pe.reshape(n, 1, -1).to(kv.dtype)
    _scatter(kv_c, ckv_cache, index)
    _scatter(k_pe, k_cache, index)
    if is_output_kv:
        return k_cache, ckv_cache, k_pe, kv_c
    return k_cache, ckv_cache, None, None


def _npu_rotary_embedding(
    positions, query, key, head_size, cos_sin_cache, is_neox_style
):
    """VLLM's `rotary_embedding` semantics, in place: query/key [n, heads *
    head_size] (rows of `head_size`, the first len(cos_sin_cache[0]) values
    rotated), cos_sin_cache [positions, cos | sin]; pairs (i, i + half) if
    is_neox_style, else (2i, 2i + 1)."""
    cos, sin = (
        cos_sin_cache.index_select(0, positions.flatten()).float().chunk(2, dim=-1)
    )
    rot = 2 * cos.shape[-1]
    for x in (query, key):
        if x is None:
            continue
        rows = x.view(x.shape[0], -1, head_size)
        r = rows[..., :rot].float()
        if is_neox_style:
            x1, x2 = r[..., : rot // 2], r[..., rot // 2 :]
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        out = (
            torch.cat((o1, o2), -1)
            if is_neox_style
            else torch.stack((o1, o2), -1).flatten(-2)
        )
        rows[..., :rot] = out.to(x.dtype)


def npu_scatter_nd_update_(self, indices, updates):
    """In place: rows `updates` [n, d] into `self` [rows, d] at rows `indices` [n, 1]
    (how vllm-ascend's SFA writes its indexer key cache, viewed as [slots, d])."""
    self[indices.to(torch.int64).view(-1)] = updates.to(self.dtype)
    return self


def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
    """X * cos + rotate_half(x) * sin ("half" mode: pairs (i, i + half)), computed in
    fp32 and cast to x's dtype; cos/sin `r1`/`r2` broadcast against x."""
    if rotary_mode != "half":
        raise NotImplementedError(f"rotary_mode={rotary_mode!r} has no CPU stub")
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), -1)
    return (xf * r1.float() + rotated * r2.float()).to(x.dtype)


def npu_dynamic_quant(x, smooth_scales=None, *, dst_type=torch.int8):
    """Per-row symmetric quantization (the last dim): scale = amax / 127 into int8
    (round half to even), or amax / 448 into float8_e4m3fn; returns (values, fp32
    scale [rows]). Computed in fp32."""
    if smooth_scales is not None:
        raise NotImplementedError("smooth_scales has no CPU stub")
    xf = x.float()
    amax = xf.abs().amax(-1)
    if dst_type == torch.int8:
        scale = amax / 127.0
        q = torch.round(xf / scale[..., None]).clamp(-128, 127).to(torch.int8)
    elif dst_type == torch.float8_e4m3fn:
        scale = amax / 448.0
        q = (xf / scale[..., None]).to(torch.float8_e4m3fn)
    else:
        raise NotImplementedError(f"dst_type={dst_type} has no CPU stub")
    return q, scale


def npu_format_cast(tensor, acl_format):
    """The plain ND format (ACL_FORMAT_FRACTAL_ND = 2) only: the tensor as it is."""
    if acl_format != 2:
        raise NotImplementedError(
            f"npu_format_cast to format {acl_format}: no CPU stub"
        )
    return tensor


npu = _Namespace("torch_npu.npu")
npu.is_available = lambda: False
npu.device_count = lambda: 0
sys.modules["torch_npu.npu"] = npu
# torch_npu registers `torch.npu`; vllm-ascend's modules refer to it.
torch.npu = npu


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _NoStub(name)
