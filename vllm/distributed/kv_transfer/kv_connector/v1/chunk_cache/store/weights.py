# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The weights version in a store key: a fingerprint of the loaded weights.

xxh3-128 over every parameter and buffer on this rank (name, dtype, shape,
bytes), taken at start-up and after each cache reset (vLLM's weight update and
reload flows reset it): replicas with the same weights share entries whatever
path they loaded them from. Seconds for a large model, once per reset.
"""

from __future__ import annotations

import torch
import xxhash
from torch import nn

FINGERPRINT_VERSION = b"chunk-weights-v1"
# Bytes per host copy of a device tensor.
_PIECE = 64 << 20


def weights_fingerprint(model: nn.Module) -> str:
    h = xxhash.xxh3_128(FINGERPRINT_VERSION)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        flat = t.contiguous().reshape(-1)
        if flat.numel() == 0:
            continue
        raw = flat.view(torch.uint8)
        for start in range(0, raw.numel(), _PIECE):
            h.update(memoryview(raw[start : start + _PIECE].cpu().numpy()))
    return h.hexdigest()
