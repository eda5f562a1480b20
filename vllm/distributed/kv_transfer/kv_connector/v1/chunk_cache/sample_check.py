# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The harness of the worker's start-up self-checks: sample rows written into
paged blocks no request holds yet (blocks 1.., block 0 is vLLM's null block),
compared byte for byte, and every touched tensor restored.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

SAMPLE_ROWS = 48


def sample_rows(kv_cache: torch.Tensor, wanted: int = SAMPLE_ROWS) -> int:
    """How many sample rows fit the blocks after the null block of `kv_cache`
    ([blocks, ..., block_size at dim 2, ...]: CPU and flash layouts alike)."""
    return max(0, min(wanted, (kv_cache.shape[0] - 1) * kv_cache.shape[2]))


def sample_slots(kv_cache: torch.Tensor, rows: int) -> torch.Tensor:
    """Paged slots of `rows` consecutive tokens from block 1 on."""
    block_size = kv_cache.shape[2]
    return torch.arange(block_size, block_size + rows, device=kv_cache.device)


def random_rows(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int
) -> torch.Tensor:
    """Random values of a K/V row's size (|x| up to ~16), in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(shape, generator=gen)).to(dtype).to(device)


def touched_blocks(kv_cache: torch.Tensor, rows: int) -> slice:
    """The blocks of `kv_cache` that the first `rows` sample slots fall in."""
    return slice(1, 1 + -(-rows // kv_cache.shape[2]))


@contextmanager
def restored(
    caches: Sequence[torch.Tensor], rows: int, others: Sequence[torch.Tensor] = ()
) -> Iterator[None]:
    """Puts back, on exit, the blocks of `caches` the sample's `rows` slots
    touch and the first `rows` rows of each of `others`."""
    saved = []
    for cache in caches:
        touched = touched_blocks(cache, rows)
        saved.append((cache, touched, cache[touched].clone()))
    for other in others:
        saved.append((other, slice(0, rows), other[:rows].clone()))
    try:
        yield
    finally:
        for tensor, where, copy in saved:
            tensor[where] = copy


def bytes_differ(got: torch.Tensor, want: torch.Tensor) -> int:
    """Bytes in which `got` differs from `want` (all of them if the shape or
    dtype differs)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return want.numel() * want.element_size()
    differ = got.contiguous().view(torch.uint8) != want.contiguous().view(torch.uint8)
    return int(differ.sum())


def choice_summary(
    chosen: str, num_chosen: int, fallback: str, reasons: dict[str, str]
) -> str:
    """The start-up line of a per-layer choice: `chosen` on the layers whose
    self-check passed, `fallback` on the others, with up to 3 reasons."""
    if not reasons:
        return f"{chosen} on all {num_chosen} layer(s)"
    head = f"{chosen} on {num_chosen} layer(s), " if num_chosen else ""
    why = "; ".join(sorted(set(reasons.values()))[:3])
    return f"{head}{fallback} on {len(reasons)} layer(s): {why}"
