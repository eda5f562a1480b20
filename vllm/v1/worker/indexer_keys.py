# SPDX-License-Identifier: Apache-2.0
"""A sparse-attention indexer key row, and how a chunk-cache load re-positions it.

DeepSeek-V3.2's lightning indexer (DSA on CUDA, SFA on Ascend) keeps one key per token and
layer beside MLA's latent row: `k = RoPE(LayerNorm(wk h), p)` on a slice of it,
`index_head_dim` wide (128 in V3.2), shared by every indexer head. A query's top-k
selection scores `sum_h w_h relu(q_h . k)` over the cached keys, so a loaded chunk must
bring its keys at the real positions, or the question ranks its tokens at the wrong
distance and attends to other tokens than the isolation semantics define.

Where the rope sits in the row, and its pairing, is the platform's (docs/design/sparse.md):

* vLLM (CUDA, `deepseek_v2.Indexer`) and HF: the **first** `qk_rope_head_dim` values, with
  `indexer_rope_emb` = DeepSeek's YaRN (mscale baked into its cos/sin, as MLA's), neox
  unless the config sets `indexer_rope_interleave`;
* vllm-ascend's SFA (`sfa_v1.py`): the first `qk_rope_head_dim` values too, rotated with
  MLA's cos/sin in the pairing `AscendSFAImpl` sets (neox except `glm_moe_dsa`), then a
  Hadamard transform over the whole row before the cache write (orthogonal, position-free,
  applied by the writer: the pool holds the row before it).

A load copies the rest of the row and rotates the rope slice alone by the delta with a
`RopeRotation` of that rope (pure rotation: the stored key carries the mscale already).
The pool keeps the key **before** any quantization (the model dtype); the backend's own
write quantizes the moved key as it would a freshly computed one.
"""

from dataclasses import dataclass

import torch

from vllm.v1.worker.position_remapper import RopeRotation


@dataclass(frozen=True)
class IndexerKeyLayout:
    """Widths of one indexer key row `[rope slice | rest]` (the slice first, as every
    platform read lays it: vLLM, HF and vllm-ascend split `[rope_dim, head_dim - rope_dim]`)."""

    head_dim: int
    rope_dim: int

    def __post_init__(self) -> None:
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(
                f"an indexer key of {self.head_dim} values cannot carry a rope slice of "
                f"{self.rope_dim} (even, at most the row)"
            )

    def check(self, keys: torch.Tensor) -> None:
        if keys.shape[-1] != self.head_dim:
            raise ValueError(
                f"indexer key rows are {self.head_dim} wide, got {keys.shape[-1]}"
            )


def check_indexer_rope(layout: IndexerKeyLayout, rotation: RopeRotation) -> None:
    """Refuse a rope that does not turn exactly the row's rope slice."""
    if rotation.head_size != layout.rope_dim or rotation.rotary_dim != layout.rope_dim:
        raise ValueError(
            f"the indexer rope rotates {rotation.rotary_dim} of {rotation.head_size} "
            f"values, the indexer key's rope slice has {layout.rope_dim}"
        )


def reposition_indexer_keys(
    layout: IndexerKeyLayout,
    rotation: RopeRotation,
    keys: torch.Tensor,
    deltas: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer key `keys` [n, head_dim] moved by `deltas` [n]: the rope slice rotated
    (in fp32, one rounding to the keys' dtype), the rest copied bit for bit. A new
    tensor unless `out` (same shape and dtype, not overlapping `keys`) is given."""
    layout.check(keys)
    check_indexer_rope(layout, rotation)
    if out is None:
        out = torch.empty_like(keys)
    rope = layout.rope_dim
    out[:, rope:].copy_(keys[:, rope:])
    # [n, 1, rope_dim]: the indexer key is one head shared by every indexer head.
    source = keys[:, None, :rope]
    if keys.dtype == torch.float32:
        rotation.rotate(source, deltas, cos_sin, out=out[:, None, :rope])
    else:
        rotated = rotation.rotate(source.float(), deltas, cos_sin)
        out[:, :rope].copy_(rotated[:, 0])
    return out
