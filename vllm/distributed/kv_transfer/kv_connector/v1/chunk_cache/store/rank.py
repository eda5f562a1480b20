# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""StoreRank: what a worker rank puts into its store keys besides the weights
fingerprint: its place in TP/PP, the model, the RoPE configuration (the HF
fields and the rotation vLLM built) and how it computes KV.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Bump when what a stored row means changes: older entries are then never read.
KV_FORMAT_VERSION = "chunk-kv-2"
# The HF config's fields that shape the rotation.
_HF_ROPE = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")


@dataclass(frozen=True)
class StoreRank:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    model: str
    rope: str
    compute: str
    """KV format version, vLLM version, attention backend(s), device kind."""
    max_chunk_tokens: int

    @classmethod
    def from_engine(cls, vllm_config: VllmConfig, model: nn.Module) -> StoreRank:
        import vllm
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        from vllm.platforms import current_platform

        parallel = vllm_config.parallel_config
        hf = vllm_config.model_config.hf_text_config
        hf_rope = {
            k: getattr(hf, k, None) for k in (*_HF_ROPE, "max_position_embeddings")
        }
        rope = json.dumps(
            {"hf": hf_rope, "built": effective_rotation(model)},
            sort_keys=True,
            default=str,
        )
        backends = sorted(
            {
                backend_name(m.attn_backend)
                for m in model.modules()
                if getattr(m, "attn_backend", None) is not None
            }
        )
        compute = json.dumps(
            {
                "kv_format": KV_FORMAT_VERSION,
                "vllm": getattr(vllm, "__version__", "?"),
                "backends": backends,
                "device": device_kind(current_platform),
            },
            sort_keys=True,
        )
        return cls(
            tp_rank=get_tp_group().rank_in_group,
            tp_size=parallel.tensor_parallel_size,
            pp_rank=get_pp_group().rank_in_group,
            pp_size=parallel.pipeline_parallel_size,
            model=str(vllm_config.model_config.served_model_name),
            rope=rope,
            compute=compute,
            max_chunk_tokens=vllm_config.chunk_cache_config.max_chunk_tokens,
        )


def effective_rotation(model: nn.Module) -> dict[str, object]:
    """The rotation vLLM built for each attention layer's keys: the distinct
    ropes' identities (position_remapper.rotation_identity) and, per layer,
    which one it used (None: no RoPE). The HF fields alone do not decide it:
    a LongRoPE model uses other factors at another --max-model-len."""
    from vllm.v1.worker.position_remapper import rotation_identity

    from ..layer_ropes import find_layer_ropes

    ropes, _ = find_layer_ropes(model)
    identities: list[str] = []
    layers: dict[str, int | None] = {}
    for name in sorted(ropes):
        rope = ropes[name]
        if rope is None:
            layers[name] = None
            continue
        identity = json.dumps(rotation_identity(rope), sort_keys=True)
        if identity not in identities:
            identities.append(identity)
        layers[name] = identities.index(identity)
    return {"ropes": identities, "layers": layers}


def backend_name(backend) -> str:
    get_name = getattr(backend, "get_name", None)
    return str(get_name()) if callable(get_name) else getattr(backend, "__name__", "?")


def device_kind(platform) -> str:
    """The platform and an accelerator's device name (kernels may round
    differently on another generation)."""
    kind = str(getattr(platform, "device_type", "?"))
    if kind in ("cpu", "?"):
        return kind
    try:
        return f"{kind}:{platform.get_device_name(0)}"
    except Exception:  # a platform without names: its kind alone
        return kind
