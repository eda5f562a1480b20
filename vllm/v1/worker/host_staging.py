# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host-to-device copies of small per-step index arrays without a sync.

A copy from pageable memory makes the host wait for it, behind the stream's
work: a sync every step, and no overlap under async scheduling. Here each
named array goes through a host buffer kept for the runner's lifetime (pinned
on CUDA), grown when needed, and the device copy is `non_blocking`.

NOTE: reusing a host buffer is safe under the runner's discipline for its own
(vLLM's CpuGpuBuffer): `synchronize_input_prep` waits for the previous step's
input copies before any buffer is written again, and without async scheduling
every step ends in a sync. On the CPU `to_device` returns the arrays as they
are; `staged` is the CUDA path, tested on the CPU with `pin=False`.
"""

import torch


class HostStaging:
    """Reused host buffers, one per name, for non-blocking copies to `device`."""

    def __init__(self, device: torch.device | str, pin: bool | None = None):
        self.device = torch.device(device)
        # Pinned where the copies go to a CUDA device (pin_memory needs one).
        self.pin = self.device.type == "cuda" if pin is None else pin
        self._buffers: dict[str, torch.Tensor] = {}

    def to_device(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """`src` (a host tensor) on the device: itself where the device is the
        host, else `staged`."""
        if src.device == self.device:
            return src
        return self.staged(name, src)

    def staged(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """A new device tensor with `src`'s values, copied from buffer `name`
        without waiting for the copy. The buffer is written again by the next
        call with the same name (see the module's NOTE)."""
        flat = src.reshape(-1)
        buffer = self._buffer(name, flat.dtype, flat.numel())
        view = buffer[: flat.numel()]
        view.copy_(flat)
        out = torch.empty(flat.numel(), dtype=flat.dtype, device=self.device)
        out.copy_(view, non_blocking=True)
        return out.view(src.shape)

    def _buffer(self, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            # NOTE: grown to a power of two so a growing batch reallocates
            # (and pins) a few times, not every step.
            size = max(64, 1 << max(0, numel - 1).bit_length())
            buffer = torch.empty(size, dtype=dtype, pin_memory=self.pin)
            self._buffers[name] = buffer
        return buffer
