# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An MLA latent cache row, and how a chunk-cache load re-positions it.

Multi-head latent attention (DeepSeek-V2/V3, V3.2) caches one row per token
for all heads, `[kv_c | k_pe]`: the normed compressed KV (no position in it)
and the decoupled RoPE key. Every head's key and value derive from them, so a
load copies `kv_c` and rotates `k_pe` alone by the delta, with a
`RopeRotation` of the model's rope (its mscale is in the stored k_pe already).
Why this is exact: docs/design/mla.md.
"""

from dataclasses import dataclass

import torch

from vllm.v1.worker.position_remapper import RopeRotation


@dataclass(frozen=True)
class LatentRowLayout:
    """Widths of one MLA cache row `[kv_c | k_pe]`."""

    kv_lora_rank: int
    rope_dim: int

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (kv_c [..., kv_lora_rank], k_pe [..., rope_dim]) of `rows`."""
        if rows.shape[-1] != self.width:
            raise ValueError(
                f"MLA latent rows are {self.width} wide (kv_lora_rank "
                f"{self.kv_lora_rank} + rope_dim {self.rope_dim}), got {rows.shape[-1]}"
            )
        return rows[..., : self.kv_lora_rank], rows[..., self.kv_lora_rank :]


def check_rope_slice(rotation: RopeRotation, rope_dim: int, what: str) -> None:
    """Refuse a rope that does not turn exactly a row's rope slice (`what`)."""
    if rotation.head_size != rope_dim or rotation.rotary_dim != rope_dim:
        raise ValueError(
            f"the rope rotates {rotation.rotary_dim} of {rotation.head_size} values "
            f"per key, {what} has {rope_dim}"
        )


def reposition_latent_rows(
    layout: LatentRowLayout,
    rotation: RopeRotation,
    rows: torch.Tensor,
    deltas: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_c, k_pe) of latent `rows` [n, width] moved by `deltas` [n]: kv_c
    unchanged (a view of `rows`), k_pe [n, rope_dim] rotated (new tensor): what
    a latent cache-write op takes. `cos_sin`: each row's, if computed already."""
    check_rope_slice(rotation, layout.rope_dim, "the latent row's k_pe")
    kv_c, k_pe = layout.split(rows)
    # [n, 1, rope_dim]: k_pe is one head shared by every query head.
    k_pe = rotation.rotate(k_pe.unsqueeze(1), deltas, cos_sin=cos_sin).squeeze(1)
    return kv_c, k_pe
