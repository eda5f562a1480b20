"""`reshape_and_cache_flash`'s arithmetic in torch: the stand-in for the CUDA backends' cache
write where the fused load is checked on the CPU (the op itself has no CPU kernel).

Read from vLLM 0.23's csrc (libtorch_stable/cache_kernels.cu, quantization/w8a8/fp8/nvidia/
quant_utils.cuh): a row goes to block slot // block_size, offset slot % block_size; fp8
caches get `__nv_cvt_float_to_fp8(float(x) / scale, __NV_SATFINITE, E4M3)`, i.e. divided
by the tensor's or the head's scale, saturated to +-448, rounded to nearest even.
"""

import torch


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
               scale: torch.Tensor | None) -> None:
    """`cache` [blocks, block_size, heads, head] (any strides), `rows` [n, heads, head]."""
    block_size = cache.shape[1]
    if cache.dtype == torch.float8_e4m3fn:
        per_head = scale.reshape(1, -1, 1) if scale.numel() > 1 else scale
        rows = (rows.float() / per_head).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    cache[slots // block_size, slots % block_size] = rows


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slots: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, fp8: bool = False) -> None:
    """Into a [blocks, 2, block_size, heads, head] cache, as FlashAttention, FlashInfer and
    Triton's `do_kv_cache_update` split it (`kv_cache.unbind(1)`)."""
    key_cache, value_cache = kv_cache.unbind(1)
    if fp8:
        key_cache = key_cache.view(torch.float8_e4m3fn)
        value_cache = value_cache.view(torch.float8_e4m3fn)
    write_rows(key_cache, key, slots, k_scale)
    write_rows(value_cache, value, slots, v_scale)
