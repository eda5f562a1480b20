# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Store keys: everything an entry's bytes depend on, then its content hash.

    chunkcache/v1/<model, readable>/<namespace digest>/<content hash, 32 hex>

The namespace digest covers every StoreNamespace field: an entry computed any
other way (model, weights, layout, rope, backend, device, rank, tenant, LoRA)
is unreachable. A key names content, it does not prove it: every value read is
verified.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import regex as re

KEY_PREFIX = "chunkcache/v1"
_READABLE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_READABLE = 48
_STRINGS = ("model", "weights_version", "kv_dtype", "kv_layout", "rope", "compute")


@dataclass(frozen=True)
class StoreNamespace:
    """What a chunk entry's KV bytes depend on besides its tokens."""

    model: str
    """The served model (its path or name as given to vLLM)."""
    weights_version: str
    """A fingerprint of the loaded weights (weights.py)."""
    kv_dtype: str
    kv_layout: str
    """Shape and order of the stored rows."""
    rope: str
    """The RoPE configuration the stored K were rotated with."""
    compute: str
    """KV format version, vLLM version, attention backend(s), device kind."""
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cache_salt: str | None
    lora: str | None

    def __post_init__(self) -> None:
        for name in _STRINGS:
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"StoreNamespace.{name} must be a non-empty string")
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            r, n = getattr(self, rank), getattr(self, size)
            if not (isinstance(r, int) and isinstance(n, int) and 0 <= r < n):
                raise ValueError(
                    f"StoreNamespace needs 0 <= {rank} < {size}, got {r}, {n}"
                )

    def digest(self) -> str:
        """BLAKE2b-128 over every field, in hex (JSON: None and "" differ)."""
        canonical = json.dumps(
            asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=True
        )
        return hashlib.blake2b(
            canonical.encode(), digest_size=16, person=b"chunkcache-ns-v1"
        ).hexdigest()


def store_key(ns: StoreNamespace, content_hash: int) -> str:
    """The store key of the entry of content hash (xxh3-128) `content_hash`."""
    if not isinstance(content_hash, int) or not 0 <= content_hash < 1 << 128:
        raise ValueError(
            f"content_hash must be a 128-bit unsigned int, got {content_hash!r}"
        )
    readable = (
        _READABLE.sub("_", ns.model.rsplit("/", 1)[-1])[:_MAX_READABLE] or "model"
    )
    return f"{KEY_PREFIX}/{readable}/{ns.digest()}/{content_hash:032x}"
