# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A sparse-attention indexer key row, and how a load re-positions it.

DeepSeek-V3.2's lightning indexer (DSA on CUDA, SFA on Ascend) caches one key
per token and layer beside MLA's latent row, `index_head_dim` wide, shared by
every indexer head, with RoPE on its first `qk_rope_head_dim` values. Its
top-k selection scores the cached keys, so a loaded chunk must bring them at
their real positions. A load copies the rest of the row and rotates the rope
slice alone with a `RopeRotation` of that rope; the pool holds the key before
any quantization or Hadamard transform (the backend's write applies them).
Where the slice sits and its pairing, per platform: docs/design/sparse.md.
"""

from dataclasses import dataclass

import torch

from vllm.v1.worker.mla_latent import check_rope_slice
from vllm.v1.worker.position_remapper import RopeRotation


@dataclass(frozen=True)
class IndexerKeyLayout:
    """Widths of one indexer key row `[rope slice | rest]` (vLLM, HF and
    vllm-ascend all split `[rope_dim, head_dim - rope_dim]`)."""

    head_dim: int
    rope_dim: int

    def __post_init__(self) -> None:
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(
                f"an indexer key of {self.head_dim} values cannot carry a rope "
                f"slice of {self.rope_dim} (even, at most the row)"
            )

    def check(self, keys: torch.Tensor) -> None:
        if keys.shape[-1] != self.head_dim:
            raise ValueError(
                f"indexer key rows are {self.head_dim} wide, got {keys.shape[-1]}"
            )


def reposition_indexer_keys(
    layout: IndexerKeyLayout,
    rotation: RopeRotation,
    keys: torch.Tensor,
    deltas: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer key `keys` [n, head_dim] moved by `deltas` [n]: the rope slice
    rotated (in fp32, one rounding to the keys' dtype), the rest copied bit for
    bit. A new tensor unless `out` (same shape and dtype, not overlapping
    `keys`) is given."""
    layout.check(keys)
    check_rope_slice(rotation, layout.rope_dim, "the indexer key's rope slice")
    if out is None:
        out = torch.empty_like(keys)
    rope = layout.rope_dim
    out[:, rope:].copy_(keys[:, rope:])
    # [n, 1, rope_dim]: one key head shared by every indexer head.
    source = keys[:, None, :rope]
    if keys.dtype == torch.float32:
        rotation.rotate(source, deltas, cos_sin, out=out[:, None, :rope])
    else:
        rotated = rotation.rotate(source.float(), deltas, cos_sin)
        out[:, :rope].copy_(rotated[:, 0])
    return out
