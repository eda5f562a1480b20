"""pytest plugin for a GPU run: keep only the tests marked GPU-only (a `skipif` whose reason
starts with "GPU-only"), whatever their parameter ids become.

    PYTHONPATH=tools/gpu TRITON_INTERPRET=0 python -m pytest -p gpu_only FILES...

NOTE: the same files hold CPU tests that run Triton kernels on CPU tensors under the
interpreter; with TRITON_INTERPRET=0 those fail (the 2026-11-25 run picked one by a -k
expression), so a GPU run selects by the mark, not by name.
"""

from __future__ import annotations


def _gpu_only(item) -> bool:
    return any(str(mark.kwargs.get("reason", "")).startswith("GPU-only")
               for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items) -> None:
    kept = [item for item in items if _gpu_only(item)]
    dropped = [item for item in items if not _gpu_only(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
