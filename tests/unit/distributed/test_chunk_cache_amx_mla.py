# SPDX-License-Identifier: Apache-2.0
"""vLLM's AMX branch of the CPU MLA backend selection, forced.

On an x86 CPU with AMX tiles vLLM 0.32 serves an MLA model with AMX_MLA unless CPU_MLA
is asked for by name: `CpuPlatform.get_attn_backend_cls` and `check_and_update_config`
both ask `torch.cpu._is_amx_tile_supported()` (read in the installed sources). No
machine of this project's developers has AMX, so the branch is forced here by a stand-in
for that one detection, and vLLM's own selection (`get_attn_backend`, the call an MLA
layer makes) runs on the tiny DeepSeek's engine config:

* without a backend named, vLLM picks AMX_MLA (and its config: block size 128, prefix
  caching kept). The chunk cache has no latent writer for it: its start-up check on the
  chosen backend's own implementation class refuses it by name and names the backend to
  start with instead, CPU_MLA.
* with the arguments the MLA engine tests pass (tests/e2e/engine.py `CPU_MLA_ARGS`),
  vLLM picks CPU_MLA (block size 16, prefix caching off), which the check accepts: the
  tiny DeepSeek's rows run CPU_MLA on an AMX machine as on any other.

vLLM 0.23 has no MLA on the CPU: with AMX forced its platform still refuses MLA.
Nothing here executes an AMX instruction: the selection and the check are Python.
"""

from __future__ import annotations

import pytest
import torch
import vllm
from torch import nn
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
    latent_writer_for,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    check_attention_layer,
)

from tests.conftest import models_dir
from tests.e2e.engine import CPU_MLA_ARGS

MODEL = str(models_dir() / "tiny-deepseek")
LATENT = 576  # the tiny DeepSeek's latent row: kv_lora_rank 512 + qk_rope_head_dim 64
ON_023 = vllm.__version__.startswith("0.23")
ONLY_032 = pytest.mark.skipif(
    ON_023,
    reason="vLLM 0.23 has no MLA on the CPU (tested "
    "below: its platform refuses it, AMX or not)",
)


@pytest.fixture
def amx(monkeypatch):
    """The platform's AMX detection answering yes; vLLM's selection cache emptied before
    and after, so no choice made under the stand-in outlives it."""
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    yield
    selector._cached_get_attn_backend.cache_clear()


def _config(dtype: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=MODEL,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=1024,
        enable_chunk_cache=True,
        **kwargs,
    ).create_engine_config()


def _selected(config, dtype: torch.dtype) -> type:
    """The backend class vLLM's own selection gives an MLA layer of this config."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    with set_current_vllm_config(config):
        return get_attn_backend(LATENT, dtype, "auto", use_mla=True)


def _layer(backend: type):
    """An MLA layer as the worker hands it to the chunk cache's start-up check: the
    chosen backend's own implementation class (not constructed: the check reads its
    type, the backend and the cache dtype only)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    impl_cls = backend.get_impl_cls()
    layer = MLAAttention.__new__(MLAAttention)  # no engine needed
    nn.Module.__init__(layer)
    layer.impl = impl_cls.__new__(impl_cls)
    layer.attn_backend = backend
    layer.kv_cache_dtype = "auto"
    layer._k_scale = torch.tensor(1.0)
    layer.kv_lora_rank, layer.qk_rope_head_dim = 512, 64
    return layer


@ONLY_032
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_forced_amx_vllm_picks_amx_mla_and_the_chunk_cache_refuses_it_naming_cpu_mla(
    amx, dtype
):
    config = _config(dtype)
    backend = _selected(config, getattr(torch, dtype))
    # vLLM's AMX branch, config and selection alike: prefix caching kept, and on 0.32
    # the AMX kernel's block size (0.33 leaves the CPU default: only the reference
    # CPU MLA kernel needs a block size of its own there).
    assert backend.get_name() == "AMX_MLA"
    assert config.cache_config.enable_prefix_caching
    if vllm.__version__.startswith("0.32"):
        assert config.cache_config.block_size == 128
    assert (
        latent_writer_for(backend.get_impl_cls().__new__(backend.get_impl_cls()))
        is None
    )
    with pytest.raises(ValueError) as refused:
        check_attention_layer("model.layers.0.self_attn.mla_attn", _layer(backend))
    message = str(refused.value)
    # Refused by name, with the backend to start with instead on this platform.
    assert "AMXMLAImpl" in message and "AMX_MLA" in message, message
    assert "--attention-backend CPU_MLA" in message, message


@ONLY_032
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_forced_amx_the_mla_tests_arguments_give_cpu_mla_which_the_chunk_cache_serves(
    amx, dtype
):
    config = _config(dtype, **CPU_MLA_ARGS)
    backend = _selected(config, getattr(torch, dtype))
    assert backend.get_name() == "CPU_MLA"
    # CPU_MLA's config, not AMX_MLA's: its decode kernel's block size, prefix caching
    # off.
    assert config.cache_config.block_size == 16
    assert not config.cache_config.enable_prefix_caching
    check_attention_layer("model.layers.0.self_attn.mla_attn", _layer(backend))


@ONLY_032
def test_unforced_the_selection_follows_this_machines_cpu():
    """The stand-in replaces the detection the selection really reads: without it, this
    machine's answer decides (AMX_MLA on Sapphire Rapids and later, CPU_MLA
    elsewhere)."""
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()
    has_amx = torch.cpu._is_amx_tile_supported()
    backend = _selected(_config("bfloat16"), torch.bfloat16)
    assert backend.get_name() == ("AMX_MLA" if has_amx else "CPU_MLA")
    backend = _selected(_config("bfloat16", **CPU_MLA_ARGS), torch.bfloat16)
    assert backend.get_name() == "CPU_MLA"


@pytest.mark.skipif(not ON_023, reason="vLLM 0.32 serves MLA on the CPU (tests above)")
def test_forced_amx_vllm_023_still_has_no_mla_on_the_cpu(amx):
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    selector_config = AttentionSelectorConfig(
        head_size=LATENT,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=None,
        use_mla=True,
    )
    with pytest.raises(NotImplementedError, match="MLA is not supported on CPU"):
        current_platform.get_attn_backend_cls(None, selector_config)
