# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The chunk cache on an MLA layer: a pool of latent rows, capture, load.

An MLA layer caches one row per token, `[kv_c | k_pe]`, for all heads
(docs/design/mla.md); its pool keeps those rows in the model dtype. The
capture reads them back from the child's slots through the backend's reader;
a load gathers them, rotates k_pe by the delta and writes through the
backend's own latent cache write. A sparse layer (docs/design/sparse.md) adds
its indexer key, `[kv_c | k_pe | index_k]`, through its indexer writer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import (
    indexer_keys_layers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
    LatentWriter,
)
from vllm.v1.worker.indexer_keys import (
    IndexerKeyLayout,
    reposition_indexer_keys,
)
from vllm.v1.worker.mla_latent import LatentRowLayout, check_rope_slice
from vllm.v1.worker.position_remapper import (
    RemapRows,
    RemapScratch,
    RopeRotation,
    StretchCosSin,
)

# Load buffers of a sparse layer's indexer key ("i": index_head_dim per row).
INDEXER_SCRATCH = (
    ("index_k", False, "i"),
    ("index_k32", True, "i"),
    ("index_k_rotated32", True, "i"),
    ("index_k_rotated", False, "i"),
)


@dataclass(frozen=True)
class IndexerPart:
    """A sparse layer's indexer keys: their row, rope and writer."""

    layout: IndexerKeyLayout
    rotation: RopeRotation
    writer: indexer_keys_layers.IndexerWriter


@dataclass
class LatentLayer:
    """One MLA layer's pool, cache and writer."""

    name: str
    layer: Any
    # A tensor, or a tuple of parts (Ascend): only its writer and reader index it.
    kv_cache: Any
    layout: LatentRowLayout
    rotation: RopeRotation | None
    writer: LatentWriter
    # [pool rows, kv_lora_rank + rope_dim (+ index_head_dim)] in the model dtype.
    pool: torch.Tensor
    # The worker's load buffers (RemapScratch.LATENT, INDEXER_SCRATCH), shared
    # by every layer.
    scratch: RemapScratch = field(default_factory=RemapScratch)
    # Sparse MLA: the indexer key after the latent row (None: dense MLA, or a
    # sparse layer reusing another layer's top-k).
    indexer: IndexerPart | None = None

    @classmethod
    def of(
        cls,
        name: str,
        layer: Any,
        kv_cache: Any,
        rotation: RopeRotation | None,
        writer: LatentWriter,
        num_rows: int,
        dtype: torch.dtype,
        scratch: RemapScratch | None = None,
    ) -> LatentLayer:
        layout = LatentRowLayout(layer.kv_lora_rank, layer.qk_rope_head_dim)
        # The reader says how wide its rows are (and refuses a cache it cannot
        # read).
        parts = kv_cache if isinstance(kv_cache, (tuple, list)) else (kv_cache,)
        device = parts[0].device
        no_slots = torch.zeros(0, dtype=torch.int64, device=device)
        width = writer.read(kv_cache, no_slots).shape[-1]
        if width != layout.width:
            raise ValueError(
                f"--enable-chunk-cache: {name}'s latent cache rows are {width} "
                f"wide, not kv_lora_rank + rope_dim = {layout.width}"
            )
        if rotation is None and layout.rope_dim > 0:
            raise ValueError(
                f"--enable-chunk-cache: the rope of MLA layer {name} was not "
                f"found, so its k_pe ({layout.rope_dim} values) cannot be re-rotated"
            )
        if rotation is not None:
            check_rope_slice(rotation, layout.rope_dim, "the latent row's k_pe")
        indexer = cls._indexer_part(name, layer, kv_cache, layout, rotation, no_slots)
        if rotation is not None and writer.k_pe_neox_style is not None:
            # The reader fixes k_pe's layout (Ascend: GPT-J rows whatever the
            # rope's forward stores): rotate pairs as they lie in the pool.
            rotation = rotation.with_pairing(writer.k_pe_neox_style)
        width = layout.width + (0 if indexer is None else indexer.layout.head_dim)
        pool = torch.zeros((num_rows, width), dtype=dtype, device=device)
        return cls(
            name,
            layer,
            kv_cache,
            layout,
            rotation,
            writer,
            pool,
            scratch if scratch is not None else RemapScratch(),
            indexer,
        )

    @staticmethod
    def _indexer_part(
        name: str,
        layer: Any,
        kv_cache: Any,
        layout: LatentRowLayout,
        rotation: RopeRotation | None,
        no_slots: torch.Tensor,
    ) -> IndexerPart | None:
        if not indexer_keys_layers.uses_indexer(layer):
            return None
        writer = indexer_keys_layers.indexer_writer_for(layer.impl)
        if writer is None:
            supported = indexer_keys_layers.supported_indexer_backends()
            raise ValueError(
                f"--enable-chunk-cache does not support the sparse MLA backend of "
                f"{name} ({type(layer.impl).__name__}): its indexer key cache has "
                f"no registered writer (supported: "
                f"{', '.join(supported) or 'none on this platform'}; "
                "docs/design/sparse.md)"
            )
        if writer.check_layer is not None:
            writer.check_layer(name, layer)
        keys = writer.read(layer, kv_cache, no_slots)
        if keys is None:
            return None
        if rotation is None:
            raise ValueError(
                f"--enable-chunk-cache: the rope of sparse MLA layer {name} was "
                "not found, so its indexer keys cannot be re-rotated"
            )
        index_layout = IndexerKeyLayout(keys.shape[-1], layout.rope_dim)
        # NOTE: the indexer's rope has the latent rope's frequencies (the same
        # rope_parameters); only the pairing is the implementation's.
        index_rotation = rotation.with_pairing(writer.neox_style(layer))
        check_rope_slice(
            index_rotation, index_layout.rope_dim, "the indexer key's rope slice"
        )
        return IndexerPart(index_layout, index_rotation, writer)

    def scratch_plan(
        self,
    ) -> tuple[tuple[tuple[str, bool, str], ...], dict[str, tuple[int, ...]]]:
        """(roles, per-row shapes) of the load buffers this layer takes."""
        shapes: dict[str, tuple[int, ...]] = {
            "c": (self.layout.kv_lora_rank,),
            "r": (self.layout.rope_dim,),
        }
        if self.indexer is None:
            return RemapScratch.LATENT, shapes
        shapes["i"] = (self.indexer.layout.head_dim,)
        return RemapScratch.LATENT + INDEXER_SCRATCH, shapes

    def capture(self, slots: torch.Tensor, pool_rows: torch.Tensor) -> None:
        """The rows just written at paged `slots` [n] into pool rows [n]."""
        rows = self.writer.read(self.kv_cache, slots)
        if self.indexer is not None:
            # NOTE: the key as the layer computed it, before any quantization.
            keys = self.indexer.writer.read(self.layer, self.kv_cache, slots)
            # A layer whose reader returns None has no IndexerPart (`of`).
            assert keys is not None
            rows = torch.cat((rows.to(self.pool.dtype), keys.to(self.pool.dtype)), -1)
        self.pool.index_copy_(0, pool_rows, rows.to(self.pool.dtype))

    def load(self, rows: RemapRows, stretches: StretchCosSin | None = None) -> None:
        """Rows `rows` of the pool to their paged slots, k_pe rotated by each
        row's delta (`stretches`: the step's cos/sin; None: from the deltas)."""
        n = rows.num_rows
        rank, width = self.layout.kv_lora_rank, self.layout.width
        pool_c, pool_r = self.pool[:, :rank], self.pool[:, rank:width]
        kv_c = self.scratch.take("kv_c", pool_c, n)
        k_pe = self.scratch.take("k_pe", pool_r, n)
        torch.index_select(pool_c, 0, rows.src_rows, out=kv_c)
        torch.index_select(pool_r, 0, rows.src_rows, out=k_pe)
        cos_sin = (
            None
            if stretches is None or rows.stretch_index is None
            else stretches.rows(rows.stretch_index)
        )
        if self.rotation is not None:
            rotation = self.rotation
            # [n, 1, rope_dim]: k_pe is one head shared by every query head.
            k_pe = self.scratch.rotated(
                lambda rows32, into: rotation.rotate(
                    rows32[:, None], rows.deltas, cos_sin, out=into[:, None]
                ),
                k_pe,
                self.scratch.take("k_pe_rotated", pool_r, n),
                ("k_pe32", "k_pe_rotated32"),
            )
        self.writer.write(self.layer, kv_c, k_pe, rows.dst_slots, self.kv_cache)
        if self.indexer is not None:
            self._load_indexer_keys(self.indexer, rows, cos_sin)

    def _load_indexer_keys(
        self,
        part: IndexerPart,
        rows: RemapRows,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """The entry's indexer keys to their slots, the rope slice rotated by
        each row's delta (k_pe's cos/sin: same frequencies), the rest copied."""
        n = rows.num_rows
        pool_i = self.pool[:, self.layout.width :]
        keys = self.scratch.take("index_k", pool_i, n)
        torch.index_select(pool_i, 0, rows.src_rows, out=keys)
        out = self.scratch.rotated(
            lambda rows32, into: reposition_indexer_keys(
                part.layout, part.rotation, rows32, rows.deltas, cos_sin, out=into
            ),
            keys,
            self.scratch.take("index_k_rotated", pool_i, n),
            ("index_k32", "index_k_rotated32"),
        )
        part.writer.write(self.layer, out, rows.dst_slots, self.kv_cache)
