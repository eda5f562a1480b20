# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Writing sparse-attention indexer key rows into a layer's cache, per impl.

A sparse MLA layer (DeepSeek-V3.2's lightning indexer) caches one indexer key
per token beside its latent row (docs/design/sparse.md); a chunk entry keeps
it before quantization, and a load writes it through the implementation's own
write, registered here (vllm-ascend registers `AscendSFAImpl`'s).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# (layer, indexer key rows [n, head_dim] at the real positions, paged slots
# [n], the layer's cache) -> None
IndexerWriteFn = Callable[[Any, torch.Tensor, torch.Tensor, Any], None]
# (layer, the layer's cache, paged slots [n]) -> indexer key rows [n, head_dim]
# as computed, before any quantization (from the cache, or from a seam the
# implementation keeps for the step), or None where this layer's cache has no
# indexer part (a layer reusing another's top-k: vllm-ascend's skip_topk).
IndexerReadFn = Callable[[Any, Any, torch.Tensor], "torch.Tensor | None"]


@dataclass(frozen=True)
class IndexerWriter:
    """How the chunk cache writes and reads one implementation's indexer keys."""

    backend: str
    write: IndexerWriteFn
    read: IndexerReadFn
    # (layer) -> whether the key's rope slice pairs halves (neox) or adjacent
    # values as this implementation rotates it.
    neox_style: Callable[[Any], bool]
    # (layer name, layer) -> None, or ValueError naming what this writer
    # cannot serve on that layer.
    check_layer: Callable[[str, Any], None] | None = None


_INDEXER_WRITERS: dict[str, IndexerWriter] = {}


def register_indexer_writer(impl_class_name: str, writer: IndexerWriter) -> None:
    _INDEXER_WRITERS[impl_class_name] = writer


def indexer_writer_for(impl: Any) -> IndexerWriter | None:
    return _INDEXER_WRITERS.get(type(impl).__name__)


def supported_indexer_backends() -> list[str]:
    return sorted({w.backend for w in _INDEXER_WRITERS.values()})


def uses_indexer(layer: Any) -> bool:
    """Whether an MLA layer is sparse (vLLM's MLAAttention `use_sparse`, or an
    indexer on the layer or its implementation)."""
    return bool(
        getattr(layer, "use_sparse", False)
        or getattr(layer, "indexer", None) is not None
        or getattr(getattr(layer, "impl", None), "has_indexer", False)
    )
