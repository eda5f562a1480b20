# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A LoRA adapter's identity in chunk keys: in this engine's pool
"<name>#<int id>", as vLLM's own LoRA and prefix caches tell adapters apart
(no file read). The fleet's store keys the weights the workers loaded
instead (docs/design/chunk-store.md, "The LoRA adapter")."""

from typing import Any


def lora_identity(lora_request: Any) -> str:
    """Empty without an adapter (None), else "<name>#<int id>"."""
    if lora_request is None:
        return ""
    return f"{lora_request.lora_name}#{int(lora_request.lora_int_id)}"
