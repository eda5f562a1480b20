# SPDX-License-Identifier: Apache-2.0
"""How many Python lines a call executes: the observable of "no per-token
Python" (issue 52). A loop per token or per row shows up as a count that grows
with the tokens; C-level work (numpy, torch, list(chain(...))) does not. A
count, not a time, so it holds on any machine and under any load."""

import gc
import sys
from collections.abc import Callable
from typing import Any


def python_lines(call: Callable[[], Any]) -> int:
    """Lines of Python executed by `call()`, in every frame it enters."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return trace

    # NOTE: a collection during `call()` runs the finalizers (`__del__`,
    # weakref callbacks) of whatever earlier tests left as garbage, and their
    # lines would be counted as the call's: in the full suite one run of the
    # manager's test counted 9 lines more for the shorter prompt. Collected
    # before, and none during.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(previous)
        if was_enabled:
            gc.enable()
    return count
