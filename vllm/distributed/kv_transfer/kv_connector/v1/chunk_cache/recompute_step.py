# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How many engine steps the boundary recompute takes: one, or one per head.

Decided once at start-up and logged (`RecomputeSteps.for_config`): where the
model runner computes query runs (`vllm/v1/worker/query_runs.py`), the
connector offers every stretch at once (`PrefillGap.next_stretches`), else
one computed stretch per step. Why: docs/design/boundary-recompute.md, "Why
one step"; where each runs: its table "Where it runs".
"""

import os
from dataclasses import dataclass
from typing import Any

# Environment variable: "1" (require), "0" (never), unset or "" (where supported).
RECOMPUTE_IN_ONE_STEP = "CHUNK_CACHE_RECOMPUTE_ONE_STEP"


@dataclass(frozen=True)
class RecomputeSteps:
    """The decision: all computed stretches in one step, or one per step."""

    one_step: bool
    # What the start-up line says (why not, where not).
    reason: str

    @classmethod
    def for_config(cls, vllm_config: Any, platform: Any = None) -> "RecomputeSteps":
        """The decision for `vllm_config` on `platform` (default: vLLM's)."""
        cfg = vllm_config.chunk_cache_config
        if cfg is None or cfg.chunk_recompute_tokens == 0:
            return cls(False, "no boundary recompute")
        value = os.environ.get(RECOMPUTE_IN_ONE_STEP, "")
        if value not in ("", "0", "1"):
            raise ValueError(f"{RECOMPUTE_IN_ONE_STEP} must be 0 or 1, got {value!r}")
        wanted = None if value == "" else value == "1"
        if wanted is False:
            return cls(False, f"one step per chunk head ({RECOMPUTE_IN_ONE_STEP}=0)")
        if platform is None:
            from vllm.platforms import current_platform as platform
        missing = _unsupported(vllm_config, platform, opted_in=bool(wanted))
        if missing is None:
            return cls(True, "every head and the question in one step (query runs)")
        if wanted:
            raise ValueError(
                f"--chunk-recompute-tokens in one step ({RECOMPUTE_IN_ONE_STEP}=1) "
                f"is not supported here: {missing}"
            )
        return cls(False, f"one step per chunk head: {missing}")


def _unsupported(vllm_config: Any, platform: Any, opted_in: bool) -> str | None:
    if platform.is_cuda() and not opted_in:
        return (
            f"on CUDA the one-step path is opt-in ({RECOMPUTE_IN_ONE_STEP}=1: "
            "FLASH_ATTN or TRITON_ATTN, any cudagraph_mode but FULL; not yet shown "
            "exact on a GPU)"
        )
    if not (platform.is_cpu() or platform.is_cuda()):
        return (
            f"query runs are built for the CPU attention backend (CPU_ATTN) and, opted "
            f"in, CUDA's FLASH_ATTN and TRITON_ATTN; not on "
            f"{getattr(platform, 'device_name', None) or 'this platform'}"
        )
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "use_mla", False):
        return "MLA attention's builders split rows by query length, decodes first"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding schedules draft tokens per request"
    if getattr(vllm_config, "use_v2_model_runner", False):
        return "the V2 model runner does not read SchedulerOutput.query_runs"
    return None
