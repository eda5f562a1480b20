# SPDX-License-Identifier: Apache-2.0
"""How many engine steps the boundary recompute takes: one, or one per head.

With `--chunk-recompute-tokens K` a prompt alternates loaded and computed
stretches (`PrefillPlan`). Where the model runner computes several query runs
per request (`SchedulerOutput.query_runs`, `vllm/v1/worker/query_runs.py`),
the connector offers every stretch at once (`PrefillGap.next_stretches`) and
a request whose documents are all cached reaches its first token in one step
(budget permitting); elsewhere it offers one computed stretch per step, as
before. Decided once at start-up and logged, never per request.

The one-step path needs: the CPU platform's CPU_ATTN backend (it takes any
number of rows over one block table and builds its metadata from the
runner's rows, with no CUDA graph; not CPU_MLA), vLLM's V1 model runner (the
V2 runner does not read `query_runs`) and no speculative decoding. On
every other set-up the multi-step path runs and the start-up line says why.
`CHUNK_CACHE_RECOMPUTE_ONE_STEP=0` keeps the multi-step path anywhere (e.g. to
measure it side by side); `=1` refuses to start where one step is not
supported.

On CUDA the one-step path is opt-in (`=1`) until a GPU run shows it exact:
FLASH_ATTN and TRITON_ATTN builders pass the runs' rows through and vLLM's
Triton kernel attends over them causally by real position (both checked on the
CPU: tests/unit/v1/worker/test_query_runs_triton_attn.py). The worker then
refuses, naming it, any other attention backend, speculative decoding and
cudagraph_mode FULL (full graphs for mixed batches); vLLM's default
FULL_AND_PIECEWISE runs a step with runs piecewise or eagerly, with its rows
capped at what FlashAttention 3's fixed buffer holds (`support.check_query_runs`,
`prefill_runs.RunRowBudget`).
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
        """The decision for `vllm_config` on `platform` (vLLM's current one by
        default; tests pass another)."""
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
            f"on CUDA the one-step path is opt-in ({RECOMPUTE_IN_ONE_STEP}=1: FLASH_ATTN "
            "or TRITON_ATTN, any cudagraph_mode but FULL; not yet shown exact on a GPU)"
        )
    if not (platform.is_cpu() or platform.is_cuda()):
        return (
            f"query runs are built for the CPU attention backend (CPU_ATTN) and, opted "
            f"in, CUDA's FLASH_ATTN and TRITON_ATTN; not on "
            f"{getattr(platform, 'device_name', None) or 'this platform'}"
        )
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "use_mla", False):
        # NOTE: vLLM's MLA builders split a batch's rows into decodes and
        # prefills by query length, assuming decodes come first; a 1-token
        # run after a longer one is not covered by a test yet.
        return "MLA attention's metadata builders split rows by query length"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding schedules draft tokens per request"
    if getattr(vllm_config, "use_v2_model_runner", False):
        return "the V2 model runner does not read SchedulerOutput.query_runs"
    return None
