"""Probes of what a load step does, shared by the checks on vllm-ascend's path
(npu_plugin_checks.py, which imports this as `step_probes` from its own folder) and the
CPU unit tests: which cos/sin a step forms, and that it reads no device value back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from vllm.v1.worker.position_remapper import RopeRotation

# Every way a tensor's value reaches the host (each a synchronisation on a device).
HOST_READS = ("__bool__", "item", "tolist", "__int__", "__float__", "cpu", "numpy")


def host_read(*args, **kwargs):
    raise AssertionError("a device value was read back on the host")


@contextmanager
def cos_sin_formed_without_host_reads() -> Iterator[list[str]]:
    """Inside: every host read of a tensor raises, and the list yielded gets the name of
    each RopeRotation method that forms a step's cos/sin ("cos_sin" from the metadata's
    integers, "cos_sin_rows" from the rows' deltas), once per call."""
    formed: list[str] = []
    saved = {name: getattr(RopeRotation, name) for name in ("cos_sin", "cos_sin_rows")}
    saved_reads = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    for name, original in saved.items():

        def counted(self, deltas, _original=original, _name=name):
            formed.append(_name)
            return _original(self, deltas)

        setattr(RopeRotation, name, counted)
    for name in HOST_READS:
        setattr(torch.Tensor, name, host_read)
    try:
        yield formed
    finally:
        for name, method in saved_reads.items():
            setattr(torch.Tensor, name, method)
        for name, method in saved.items():
            setattr(RopeRotation, name, method)
