# SPDX-License-Identifier: Apache-2.0
"""The chunk cache on an MLA layer: a pool of latent rows, capture, load.

An MLA layer caches one row per token, `[kv_c | k_pe]`, for all heads
(docs/design/mla.md). Its pool is those rows, in the model dtype, K only.
* Capture: vLLM hands the connector the layer's latent cache, not kv_c and
  k_pe; the cache write has run before (`unified_mla_kv_cache_update`), so
  the child's rows are read back from its slots through the backend's
  registered reader (a plain cache in the model dtype: the bytes written).
* Load: gather the entry's rows (kv_c and k_pe apart, into the worker's load
  buffers: nothing allocated per layer), rotate k_pe alone by the delta, and
  write both through the backend's own latent cache write, as for freshly
  computed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
    LatentWriter,
)
from vllm.v1.worker.mla_latent import LatentRowLayout, check_latent_rope
from vllm.v1.worker.position_remapper import (
    RemapRows,
    RemapScratch,
    RopeRotation,
    StretchCosSin,
)


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
    # The worker's load buffers (RemapScratch.LATENT roles), shared by every
    # layer; buffers of its own if none is given (tests).
    scratch: RemapScratch = field(default_factory=RemapScratch)

    @classmethod
    def of(cls, name: str, layer: Any, kv_cache: Any, rotation: RopeRotation | None,
           writer: LatentWriter, num_rows: int, dtype: torch.dtype,
           scratch: RemapScratch | None = None) -> "LatentLayer":
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
        if rotation is not None:
            check_latent_rope(layout, rotation)
        if rotation is not None and writer.k_pe_neox_style is not None:
            # The reader fixes k_pe's layout (Ascend: GPT-J rows whatever the
            # rope's forward stores): rotate pairs as they lie in the pool.
            rotation = rotation.with_pairing(writer.k_pe_neox_style)
        pool = torch.zeros((num_rows, layout.width), dtype=dtype, device=device)
        return cls(name, layer, kv_cache, layout, rotation, writer, pool,
                   scratch if scratch is not None else RemapScratch())

    def capture(self, slots: torch.Tensor, pool_rows: torch.Tensor) -> None:
        """The rows just written at paged `slots` [n] into pool rows [n]."""
        rows = self.writer.read(self.kv_cache, slots)
        self.pool.index_copy_(0, pool_rows, rows.to(self.pool.dtype))

    def load(self, rows: RemapRows, stretches: StretchCosSin | None = None) -> None:
        """Rows `rows` of the pool to their paged slots, k_pe rotated by each
        row's delta (`stretches`: the step's cos/sin per stretch; without it,
        tests, the deltas are read on the host)."""
        n = rows.num_rows
        rank = self.layout.kv_lora_rank
        pool_c, pool_r = self.pool[:, :rank], self.pool[:, rank:]
        kv_c = self.scratch.take("kv_c", pool_c, n)
        k_pe = self.scratch.take("k_pe", pool_r, n)
        torch.index_select(pool_c, 0, rows.src_rows, out=kv_c)
        torch.index_select(pool_r, 0, rows.src_rows, out=k_pe)
        if self.rotation is not None:
            cos_sin = (None if stretches is None or rows.stretch_index is None
                       else stretches.rows(rows.stretch_index))
            out = self.scratch.take("k_pe_rotated", pool_r, n)
            if k_pe.dtype == torch.float32:
                # [n, 1, rope_dim]: k_pe is one head shared by every query head.
                self.rotation.rotate(k_pe[:, None], rows.deltas, cos_sin, out=out[:, None])
            else:
                # The rotation runs in fp32 (position_remapper's module doc).
                k_pe32 = self.scratch.take("k_pe32", k_pe, n, torch.float32)
                k_pe32.copy_(k_pe)
                rotated32 = self.scratch.take("k_pe_rotated32", k_pe, n, torch.float32)
                self.rotation.rotate(k_pe32[:, None], rows.deltas, cos_sin,
                                     out=rotated32[:, None])
                out.copy_(rotated32)
            k_pe = out
        self.writer.write(self.layer, kv_c, k_pe, rows.dst_slots, self.kv_cache)
