# SPDX-License-Identifier: Apache-2.0
"""A LoRA adapter's identity in chunk keys.

In this engine's pool: "<name>#<int id>", the adapter as vLLM itself tells adapters
apart (its LoRA caches and its prefix cache key on them), no file read.

In the fleet's store: "<name>@<digest of the weights the workers loaded>", taken
where each worker loads the adapter (store/lora_loads.py) and reported up; an
adapter no worker has reported yet (or whose ranks disagree) is neither read nor
written (computed here). NOTE (issue 50, finding 6): the identity was a digest of
the adapter's files, which an adapter rewritten in place under the same path and
id (the worker keeps the old weights), or a copy keeping sizes and mtimes, made
wrong; and the first digest read every byte on the engine-core thread.

NOTE: within one engine, an id is trusted to name the weights vLLM loaded for it:
vLLM's own prefix cache does the same (docs/design/chunk-store.md, "LoRA").
"""

from __future__ import annotations

from typing import Any


def lora_identity(lora_request: Any | None) -> str:
    """ "" without an adapter, else "<name>#<int id>"."""
    if lora_request is None:
        return ""
    return f"{lora_request.lora_name}#{int(lora_request.lora_int_id)}"
