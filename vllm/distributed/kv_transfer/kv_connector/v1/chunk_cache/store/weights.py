# SPDX-License-Identifier: Apache-2.0
"""The weights version in a store key: a fingerprint of the loaded weights.

xxh3-128 over every parameter and buffer of the model on this rank (name,
dtype, shape, bytes), taken when the worker first sees an epoch (start-up,
and after each cache reset, which vLLM's weight update and reload flows
call). Replicas with the same weights get the same version whatever path
they loaded them from; a replica whose weights changed gets another one, so
it neither serves nor reads entries of the old weights
(docs/design/store-path.md).

NOTE: it reads every weight once (on a GPU, not executed here, through host copies of
64 MiB pieces): seconds for a large model, once per reset, not per request.
"""

from __future__ import annotations

import torch
import xxhash
from torch import nn

FINGERPRINT_VERSION = b"chunk-weights-v1"
# Bytes hashed per host copy (bounds the host memory a GPU tensor takes).
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
