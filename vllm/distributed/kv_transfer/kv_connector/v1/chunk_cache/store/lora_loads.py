# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The LoRA adapters a worker loaded, by what it loaded.

A store key names the adapter that computed an entry. Its files do not say
that (an adapter rewritten in place keeps its old weights in the worker), so
the digest is taken over the tensors of each `LoRAModel` the worker's LoRA
manager adds. The scheduler keys an adapter's entries only by a digest every
rank reported.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import torch

# The store identity of an adapter: "<name>@<digest of the loaded weights>".
LOADED_SEP = "@"


def loaded_digest(lora_model: Any) -> str:
    """BLAKE2b-128 over module names, scalings and the bytes of every LoRA A/B
    tensor of a loaded `LoRAModel` (packed modules: each slice, None marked)."""
    h = hashlib.blake2b(digest_size=16, person=b"chunk-lora-ld-v1")
    h.update(f"rank={getattr(lora_model, 'rank', None)}\0".encode())
    for name in sorted(lora_model.loras):
        weights = lora_model.loras[name]
        h.update(f"{name}\0{getattr(weights, 'scaling', None)}\0".encode())
        for part in (weights.lora_a, weights.lora_b):
            for t in part if isinstance(part, (list, tuple)) else [part]:
                if t is None:
                    h.update(b"none\0")
                    continue
                t = t.detach().to("cpu").contiguous()
                h.update(f"{t.dtype}{tuple(t.shape)}\0".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class LoadedLoras:
    """The digests of the adapters this worker holds now, by int id; the loads
    since the last report (`take_loads`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.digests: dict[int, str] = {}
        self._loads: dict[int, str] = {}

    def note(self, lora_model: Any) -> None:
        digest = loaded_digest(lora_model)
        with self._lock:
            self.digests[int(lora_model.id)] = digest
            self._loads[int(lora_model.id)] = digest

    def take_loads(self) -> dict[int, str]:
        with self._lock:
            loads, self._loads = self._loads, {}
        return loads

    def holds(self, digest: str) -> bool:
        """Whether an adapter with these weights is loaded now."""
        with self._lock:
            return digest in self.digests.values()

    def watch(self, model: Any) -> bool:
        """Digest every adapter the model's LoRA manager adds from now on (every
        load goes through `_add_adapter`); False without LoRA."""
        manager = getattr(model, "lora_manager", None)
        add = getattr(manager, "_add_adapter", None)
        if manager is None or not callable(add):
            return False

        def _add_adapter(lora_model, *args, **kwargs):
            result = add(lora_model, *args, **kwargs)
            self.note(lora_model)
            return result

        manager._add_adapter = _add_adapter
        return True


def adapter_of(identity: str) -> tuple[str, int] | None:
    """(name, int id) of a local identity "<name>#<int id>"; None for ""."""
    if not identity:
        return None
    name, _, lora_id = identity.rpartition("#")
    return name, int(lora_id)
