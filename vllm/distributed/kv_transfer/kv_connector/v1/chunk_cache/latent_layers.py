# SPDX-License-Identifier: Apache-2.0
"""The chunk cache on an MLA layer: a pool of latent rows, capture, load.

An MLA layer caches one row per token, `[kv_c | k_pe]`, for all heads
(docs/design/mla.md). Its pool is those rows, in the model dtype, K only.
* Capture: vLLM hands the connector the layer's latent cache, not kv_c and
  k_pe; the cache write has run before (`unified_mla_kv_cache_update`), so
  the child's rows are read back from its slots through the backend's
  registered reader (a plain cache in the model dtype: the bytes written).
* Load: gather the entry's rows, copy kv_c, rotate k_pe alone by the delta
  (`reposition_latent_rows`), and write both through the backend's own
  latent cache write, as for freshly computed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
    LatentWriter,
)
from vllm.v1.worker.mla_latent import LatentRowLayout, reposition_latent_rows
from vllm.v1.worker.position_remapper import RemapRows, RopeRotation


@dataclass
class LatentLayer:
    """One MLA layer's pool, cache and writer."""

    name: str
    layer: Any
    # The layer's latent cache as its backend keeps it (a tensor, or a tuple
    # of parts on Ascend); only the registered writer and reader index it.
    kv_cache: Any
    layout: LatentRowLayout
    rotation: RopeRotation | None
    writer: LatentWriter
    # [pool rows, kv_lora_rank + rope_dim] in the model dtype.
    pool: torch.Tensor

    @classmethod
    def of(cls, name: str, layer: Any, kv_cache: Any, rotation: RopeRotation | None,
           writer: LatentWriter, num_rows: int, dtype: torch.dtype) -> "LatentLayer":
        layout = LatentRowLayout(layer.kv_lora_rank, layer.qk_rope_head_dim)
        # NOTE: the latent cache is one tensor (vLLM) or a tuple of parts
        # (vllm-ascend: latent and rope caches): its reader says how wide the
        # rows it returns are (and refuses a cache form it cannot read).
        parts = kv_cache if isinstance(kv_cache, (tuple, list)) else (kv_cache,)
        device = parts[0].device
        no_slots = torch.zeros(0, dtype=torch.int64, device=device)
        width = writer.read(kv_cache, no_slots).shape[-1]
        if width != layout.width:
            raise ValueError(
                f"chunk cache: {name}'s latent cache rows are {width} wide, "
                f"not kv_lora_rank + rope_dim = {layout.width}")
        if rotation is None and layout.rope_dim > 0:
            # k_pe carries the position: loading it unrotated would be wrong.
            raise ValueError(
                f"chunk cache: the rope of MLA layer {name} was not found, so its "
                f"k_pe ({layout.rope_dim} values) could not be re-rotated")
        if rotation is not None and writer.k_pe_neox_style is not None:
            # The reader fixes k_pe's layout (Ascend: GPT-J rows whatever the
            # rope's forward stores): rotate pairs as they lie in the pool.
            rotation = rotation.with_pairing(writer.k_pe_neox_style)
        pool = torch.zeros((num_rows, layout.width), dtype=dtype, device=device)
        return cls(name, layer, kv_cache, layout, rotation, writer, pool)

    def capture(self, slots: torch.Tensor, pool_rows: torch.Tensor) -> None:
        """The rows just written at paged `slots` [n] into pool rows [n]."""
        rows = self.writer.read(self.kv_cache, slots)
        self.pool.index_copy_(0, pool_rows, rows.to(self.pool.dtype))

    def load(self, rows: RemapRows,
             cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        latent = self.pool.index_select(0, rows.src_rows)
        if self.rotation is None:
            kv_c, k_pe = self.layout.split(latent)
        else:
            kv_c, k_pe = reposition_latent_rows(self.layout, self.rotation, latent,
                                                rows.deltas, cos_sin)
        self.writer.write(self.layer, kv_c.contiguous(), k_pe.contiguous(), rows.dst_slots,
                          self.kv_cache)
