"""The `__main__` of the Ascend check scripts: one check, as before, or a batch.

    python npu_stub_checks.py CHECK [ARG ...]         one check in this process
    python npu_stub_checks.py --batch CHECK[::ARG...] [CHECK[::ARG...] ...]

NOTE: a check's process spends ~20 s of CPU importing torch, vLLM and vllm-ascend
and well under a second checking; twenty such processes were ~7 minutes of CI on
an AVX2 machine. A batch imports the modules every check of the script imports
(`preload`, after the script's own preamble, in the order a single check would)
once, then runs each check in a child forked from that process: a check still
starts from the same imported state and cannot leave anything behind for the next
(the platform it installs, vllm-ascend's patches, registries), as in a process of
its own. The parent runs no op before forking (no thread pool to inherit).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable

BEGIN = "=== check "
END = "=== exit "
ARGS = "::"  # separates a batched check's name from its arguments


def main(
    checks: dict[str, Callable], preamble: Callable[[], None], preload: tuple[str, ...]
) -> None:
    argv = sys.argv[1:]
    preamble()
    if argv[0] != "--batch":
        checks[argv[0]](*argv[1:])
        print("OK", argv[0])
        return
    for name in preload:
        importlib.import_module(name)
    for token in argv[1:]:
        name, *args = token.split(ARGS)
        print(BEGIN + name, flush=True)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(sys.stdout.fileno(), 2)  # the check's warnings go with its output
            code = 0
            try:
                checks[name](*args)
                print("OK", name)
            except BaseException:  # noqa: BLE001 - reported to the parent's reader
                traceback.print_exc(file=sys.stdout)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(f"{END}{name} {os.waitstatus_to_exitcode(status)}", flush=True)
