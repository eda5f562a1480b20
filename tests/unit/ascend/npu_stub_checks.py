"""Checks of the fork's Ascend code path on CPU, run in a subprocess by
test_ascend_stubbed.py with the stub `torch_npu` (tests/unit/ascend/stubs) and the
patched, materialised vllm-ascend tree on PYTHONPATH. Labelled for what they are:
they run the fork's and vllm-ascend's Python code (registration, DeviceOperator
dispatch, the remapper) against CPU reference implementations of two NPU ops, so
they check index and layout math, not the NPU ops.

    python npu_stub_checks.py CHECK_NAME
"""

from __future__ import annotations

import sys
import types

import torch

# vllm-ascend reads its build's SoC from a generated module; A2 here (A5 is
# exercised by swapping the adaptor class below).
_build_info = types.ModuleType("vllm_ascend._build_info")
_build_info.__device_type__ = "A2"
sys.modules["vllm_ascend._build_info"] = _build_info


def _device_op():
    import vllm_ascend
    import vllm_ascend.ops  # noqa: F401 - device_op is imported through ops first
    from vllm_ascend.device import device_op

    vllm_ascend._build_info = _build_info
    return device_op


def check_registration_covers_standard_attention_only() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import cache_writers
    from vllm_ascend.distributed.kv_transfer import register_connector

    register_connector()  # the patched plugin entry point
    named = lambda n: type(n, (), {})()  # noqa: E731 - an instance of a class named n
    writer = cache_writers.writer_for(named("AscendAttentionBackendImpl"))
    assert writer is not None and writer.backend == "ASCEND", writer
    for refused in ("AscendMLAImpl", "AscendSFAImpl", "AscendDSAImpl",
                    "AscendC8AttentionBackendImpl"):
        assert cache_writers.writer_for(named(refused)) is None, refused
        assert cache_writers.latent_writer_for(named(refused)) is None, refused


def check_load_path_writes_rotated_rows_through_device_operator() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.worker.position_remapper import PositionRemapper, RemapRows, RopeRotation
    from vllm_ascend.distributed.chunk_cache_npu import write_rows_npu

    device_op = _device_op()
    heads, dim, block_size, num_blocks = 2, 64, 128, 4  # NPU block size 128
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(dim, 4096, True, {"rope_type": "default"}, torch.float32)
    rotation = RopeRotation(rope)
    gen = torch.Generator().manual_seed(0)
    raw_k = torch.randn(10, heads * dim, generator=gen)
    stored_pos = torch.arange(1, 11)  # a chunk computed after its sink
    _, pool_k = rope.forward_native(stored_pos, raw_k.clone(), raw_k.clone())
    pool_k = pool_k.view(10, heads, dim)
    pool_v = torch.randn(10, heads, dim, generator=gen)
    real_pos = torch.arange(300, 310)  # its place in the request
    _, want_k = rope.forward_native(real_pos, raw_k.clone(), raw_k.clone())
    slots = torch.tensor([2 * block_size + 44 + i for i in range(10)])

    for adaptor in (device_op.BaseDeviceAdaptor, device_op.A5DeviceAdaptor):
        device_op.DeviceOperator = adaptor  # A2/A3, then A5
        key_cache = torch.zeros(num_blocks, block_size, heads, dim)
        value_cache = torch.zeros(num_blocks, block_size, heads, dim)
        layer = types.SimpleNamespace(kv_cache=[key_cache, value_cache])
        remapper = PositionRemapper(
            rotation, lambda name, k, v, s: write_rows_npu(layer, k, v, s, None))
        rows = RemapRows(src_rows=torch.arange(10), dst_slots=slots,
                         deltas=torch.full((10,), 299))
        remapper.remap_layer("layer.0", pool_k, pool_v, rows)
        got_k = key_cache[2, 44:54]
        got_v = value_cache[2, 44:54]
        assert torch.allclose(got_k, want_k.view(10, heads, dim), atol=1e-4), adaptor
        assert torch.equal(got_v, pool_v), adaptor
        untouched = torch.ones(num_blocks, block_size, dtype=torch.bool)
        untouched[2, 44:54] = False
        assert key_cache[untouched].abs().sum() == 0, "rows written outside their slots"


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print("OK", sys.argv[1])
