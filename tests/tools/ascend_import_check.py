"""Run by test_ascend_build.py in a fresh interpreter whose PYTHONPATH starts with a
folder holding the two Ascend artifacts installed (`pip install --target`): vLLM's
empty-target wheel and the wheel vllm-ascend's own setup.py builds from the patched
sdist without its kernels. Prints one JSON report; the test judges it.

argv: the conftest.py of vllm-ascend's tests/ut (from the patched sdist), then module
names. That conftest is the mock `torch_npu` `./fork upstream-tests --ascend` runs
vllm-ascend's unit tests under: where `npu-smi` is absent it puts a mock torch_npu (and
acl, triton's runtime) in sys.modules, imports vllm_ascend.utils, applies vllm-ascend's
patches (adapt_patch) and registers its custom ops. Running it here is that set-up,
outside pytest.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata as md
import json
import runpy
import sys


def main() -> None:
    conftest, modules = sys.argv[1], sys.argv[2:]
    runpy.run_path(conftest, run_name="vllm_ascend_ut_conftest")
    import torch_npu
    import vllm
    import vllm_ascend
    from vllm_ascend.utils import vllm_version_is

    report = {
        "torch_npu_is_the_mock": getattr(torch_npu.__spec__, "loader", "?") is None
        and not getattr(torch_npu, "__file__", None),
        "vllm_file": vllm.__file__,
        "vllm_ascend_file": vllm_ascend.__file__,
        "vllm_version_attr": vllm.__version__,
        "vllm_dist_version": md.version("vllm"),
        "vllm_ascend_dist_version": md.version("vllm_ascend"),
        "vllm_version_is_0_23_0": vllm_version_is("0.23.0"),
        "vllm_ascend_general_plugins": sorted(
            ep.name
            for ep in md.entry_points(group="vllm.general_plugins")
            if ep.value.startswith("vllm_ascend")
        ),
        "modules": {},
    }
    for name in modules:
        mod = importlib.import_module(name)
        with open(mod.__file__, "rb") as f:
            data = f.read()
        report["modules"][name] = {
            "file": mod.__file__,
            "sha256": hashlib.sha256(data).hexdigest(),
            "text": data.decode(),
        }
    # vllm-ascend's general plugin (patch 0002 calls the overlay's registration from
    # it): the fork's NPU writers end up in the fork's vLLM registries, from the empty
    # wheel.
    from vllm_ascend.distributed.kv_transfer import register_connector

    register_connector()
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import cache_writers
    from vllm_ascend.distributed import chunk_cache_npu

    writer = cache_writers._WRITERS.get("AscendAttentionBackendImpl")
    latent = cache_writers._LATENT_WRITERS.get("AscendMLAImpl")
    report["registered"] = {
        "cache_writers_file": cache_writers.__file__,
        "standard_attention_writer_is_the_overlay's": writer is not None
        and writer.write is chunk_cache_npu.write_rows_npu,
        "mla_writer_is_the_overlay's": latent is not None
        and latent.write is chunk_cache_npu.write_latent_npu,
    }
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
