"""vLLM's own Triton cache write (`triton_reshape_and_cache_flash`, the write of its
TRITON_ATTN backend and the Triton twin of the CUDA backends'
`reshape_and_cache_flash`), run unchanged by Triton's interpreter on the CPU: the
independent oracle the CPU tests compare the chunk cache's fused kernel, self-checks and
readers with.

vLLM binds `vllm.triton_utils.triton` to a placeholder when no GPU driver is active, so
the kernel's module is executed afresh here with the real `triton` in that place (its
source is vLLM's, not a copy). The wrapper asks `torch.cuda.get_device_capability` only
to pick a tile size; on the CPU that question gets a fixed answer.

Not an oracle for fp8 caches: the interpreter's fp32 -> fp8 e4m3 store neither saturates
(NaN past 448) nor rounds to nearest even (seen on vLLM 0.23 / Triton 3.6: -31.9 ->
-16), unlike the CUDA op. The fp8 cases compare with the CUDA op and run on a GPU only.
"""

import contextlib
import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton compiles anything

import torch

_MODULE = "vllm.v1.attention.ops.triton_reshape_and_cache_flash"
_module = None


def _vllm_triton_module():
    global _module
    if _module is None:
        import triton
        import triton.language as tl
        import vllm.triton_utils as triton_utils

        spec = importlib.util.find_spec(_MODULE)
        saved = triton_utils.triton, triton_utils.tl
        triton_utils.triton, triton_utils.tl = triton, tl
        try:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            triton_utils.triton, triton_utils.tl = saved
        _module = module
    return _module


@contextlib.contextmanager
def _capability():
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


def write_rows(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """`key`/`value` [n, heads, head] into caches [blocks, block_size, heads, head] (any
    strides with a contiguous head dim: NHD, or FlashInfer's HND transposed)."""
    if key_cache.dtype == torch.float8_e4m3fn:
        raise NotImplementedError("fp8: see the module docstring (GPU-only)")
    one = torch.ones(1, dtype=torch.float32)
    with _capability():
        _vllm_triton_module().triton_reshape_and_cache_flash(
            key, value, key_cache, value_cache, slots, "auto", one, one
        )


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """Into a [blocks, 2, block_size, heads, head] cache, split as FlashAttention,
    FlashInfer and Triton's `do_kv_cache_update` split it (`kv_cache.unbind(1)`)."""
    key_cache, value_cache = kv_cache.unbind(1)
    write_rows(key_cache, value_cache, key, value, slots)
