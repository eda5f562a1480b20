# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which layers load through the fused Triton kernel, decided at start-up.

The kernel (`vllm/v1/worker/fused_chunk_load.py`) replaces a layer's gather +
rotation + backend cache write only where a self-check writes **the same
bytes** as that path on the layer's own cache, dtype, layout and scales: one
launch per RoPE and shape, 48 rows gathered out of order in 6 stretches
(`_SAMPLE_DELTAS`) into blocks no request holds yet; caches and pools are
restored. Other layers keep that path, logged with the reason. The launches'
tables of addresses are built at the first load, outside the KV-cache memory
pool a sleep discards (`FusedLayers.group`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.sample_check import (
    bytes_differ,
    choice_summary,
    random_rows,
    restored,
    sample_rows,
    sample_slots,
    touched_blocks,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.support import (
    UNQUANTIZED_KV_CACHE_DTYPES,
)
from vllm.v1.worker.position_remapper import RopeRotation

if TYPE_CHECKING:
    from vllm.v1.worker.fused_chunk_load import FusedGroup, PagedLayer

# Backends whose paged cache is [num_blocks, 2, block_size, heads, head] (NHD,
# or HND through its strides) and whose write is reshape_and_cache_flash's
# arithmetic (the self-check still decides), with their --attention-backend.
_FUSED_BACKENDS = {
    "FlashAttentionImpl": "FLASH_ATTN",
    "FlashInferImpl": "FLASHINFER",
    "TritonAttentionImpl": "TRITON_ATTN",
}
# KV-cache dtypes the kernel writes: the model's own, or fp8 e4m3.
_FP8 = ("fp8", "fp8_e4m3")
# The self-check's stretches: deltas of both signs, up to 40,000.
_SAMPLE_DELTAS = (0, 3, -700, 2900, 40000, -1)

# (layer, key rows, value rows, kv_cache, slots) -> None: the backend's write.
ReferenceWrite = Callable[
    [Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]


@dataclass
class FusedLayers:
    """Layers loaded by one launch of the fused kernel, and their RoPE."""

    names: tuple[str, ...]
    rotation: RopeRotation | None
    pool_keys: tuple[torch.Tensor, ...]
    pool_values: tuple[torch.Tensor, ...]
    paged: tuple[PagedLayer, ...]
    _group: FusedGroup | None = field(default=None, repr=False)

    @property
    def fp8(self) -> bool:
        return self.paged[0].key_cache.dtype == torch.float8_e4m3fn

    def build(self) -> FusedGroup:
        from vllm.v1.worker.fused_chunk_load import FusedGroup

        return FusedGroup.of(
            list(self.pool_keys), list(self.pool_values), list(self.paged)
        )

    @property
    def group(self) -> FusedGroup:
        """Built at first use, never in register_kv_caches (module doc)."""
        if self._group is None:
            self._group = self.build()
        return self._group


@dataclass
class FusedLoadChoice:
    """The layers that load through the fused kernel, and why the others do not."""

    # layer name -> its paged caches as the kernel writes them.
    layers: dict[str, PagedLayer] = field(default_factory=dict)
    # layer name -> why it keeps the generic path (start-up log).
    reasons: dict[str, str] = field(default_factory=dict)
    # The launches that load `layers`, one per RoPE and shape.
    launches: list[FusedLayers] = field(default_factory=list)

    def summary(self) -> str:
        if not self.reasons and not self.layers:
            return "no standard attention layer (nothing for the fused kernel)"
        return choice_summary(
            "the fused Triton load kernel",
            len(self.layers),
            "gather + rotation + the backend's cache write",
            self.reasons,
        )


def group_fused_layers(
    choice: FusedLoadChoice,
    pool_key: dict[str, torch.Tensor],
    pool_value: dict[str, torch.Tensor],
    rotations: dict[str, RopeRotation | None],
) -> list[FusedLayers]:
    """The fused layers in as few launches as they allow: one per RoPE and
    shape (strides, dtypes) of pool and cache; for a usual model, one."""
    buckets: dict[tuple, list[str]] = {}
    for name, paged in choice.layers.items():
        key, cache = pool_key[name], paged.key_cache
        pool_shape = (key.shape[1:], key.stride(), key.dtype)
        cache_shape = (cache.shape, cache.stride(), cache.dtype)
        scales = None if paged.k_scale is None else paged.k_scale.numel()
        bucket = (id(rotations[name]), pool_shape, cache_shape, scales)
        buckets.setdefault(bucket, []).append(name)
    return [
        FusedLayers(
            tuple(names),
            rotations[names[0]],
            tuple(pool_key[n] for n in names),
            tuple(pool_value[n] for n in names),
            tuple(choice.layers[n] for n in names),
        )
        for names in buckets.values()
    ]


def fused_load_expected(vllm_config: Any) -> bool:
    """Whether every layer is expected to load through the fused kernel, as
    far as the config tells before any layer exists (setup.load_scratch_rows
    sizes the load buffers from it); `choose_fused_layers` decides later."""
    from vllm.platforms import current_platform
    from vllm.v1.worker import fused_chunk_load

    if (
        getattr(current_platform, "device_type", "cpu") != "cuda"
        or not fused_chunk_load.available()
        or getattr(vllm_config.model_config, "use_mla", False)
    ):
        return False
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype not in UNQUANTIZED_KV_CACHE_DTYPES and cache_dtype not in _FP8:
        return False
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return (
        backend is None
        or getattr(backend, "name", str(backend)) in _FUSED_BACKENDS.values()
    )


def paged_layer(layer: Any, kv_cache: Any) -> PagedLayer | str:
    """The kernel's view of a layer's cache, or a reason string it has none."""
    from vllm.v1.worker.fused_chunk_load import PagedLayer, available

    if not isinstance(kv_cache, torch.Tensor):
        return "a paged cache of several tensors"
    if not available(kv_cache.device):
        # NOTE: Triton runs on CPU tensors only in its interpreter; the CPU
        # backend packs its cache per ISA.
        if kv_cache.device.type == "cpu":
            return "the CPU backend's own cache write"
        return "Triton is not installed"
    impl = getattr(layer, "impl", None)
    name = type(impl).__name__
    if name not in _FUSED_BACKENDS:
        return f"backend {name} has no fused load"
    if getattr(impl, "_is_per_token_head_quant", False):
        return "per-token-head quantized KV cache"
    if layer.head_size_v != layer.head_size:
        return "K and V head sizes differ"
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        return f"unexpected paged cache shape {tuple(kv_cache.shape)}"
    dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    key_cache, value_cache = kv_cache.unbind(1)
    if dtype in _FP8:
        key_cache = key_cache.view(torch.float8_e4m3fn)
        value_cache = value_cache.view(torch.float8_e4m3fn)
        return PagedLayer(key_cache, value_cache, layer._k_scale, layer._v_scale)
    if dtype not in UNQUANTIZED_KV_CACHE_DTYPES:
        return f"KV-cache dtype {dtype}"
    return PagedLayer(key_cache, value_cache)


def self_check_launch(
    launch: FusedLayers,
    layers: dict[str, Any],
    kv_caches: dict[str, torch.Tensor],
    pool_dtype: torch.dtype,
    reference_write: ReferenceWrite,
) -> str | None:
    """None if one launch over all of `launch`'s layers writes the bytes the
    generic path writes into every layer's cache; else why not, naming the
    first layer that differs. Leaves the caches and the pools as they were."""
    from vllm.v1.worker.fused_chunk_load import fused_load

    names = launch.names
    caches = [kv_caches[n] for n in names]
    rows = min(
        [sample_rows(c) for c in caches] + [k.shape[0] for k in launch.pool_keys]
    )
    if rows < len(_SAMPLE_DELTAS):
        return "no free block for the self-check"
    device = caches[0].device
    rotation = launch.rotation
    stretch_index = (torch.arange(rows) % len(_SAMPLE_DELTAS)).to(device)
    deltas = torch.tensor(_SAMPLE_DELTAS)
    src_rows = torch.arange(rows - 1, -1, -1, device=device)  # out of order
    slots = sample_slots(caches[0], rows)
    pools = list(launch.pool_keys) + list(launch.pool_values)
    want: dict[str, torch.Tensor] = {}

    def touched(name: str) -> torch.Tensor:
        return kv_caches[name][touched_blocks(kv_caches[name], rows)].clone()

    try:
        with restored([], rows, others=pools):
            for seed, pool in enumerate(pools):
                # Other rows per tensor: a table entry pointing at another
                # layer's tensors is a difference.
                pool[:rows] = random_rows(pool[:rows].shape, pool_dtype, device, seed)
            stretches = None
            if rotation is not None:
                stretches = rotation.stretch_cos_sin(deltas, device)
            with restored(caches, rows):
                for name, key, value in zip(
                    names, launch.pool_keys, launch.pool_values
                ):
                    moved, plain = key[src_rows], value[src_rows]
                    if rotation is not None and stretches is not None:
                        moved = rotation.rotate(
                            moved.float(),
                            deltas[stretch_index.cpu()],
                            stretches.rows(stretch_index),
                        ).to(pool_dtype)
                    reference_write(layers[name], moved, plain, kv_caches[name], slots)
                    want[name] = touched(name)
            with restored(caches, rows):
                # The table the first load builds (then dropped: see module doc).
                fused_load(
                    launch.build(),
                    src_rows,
                    slots,
                    None if stretches is None else stretch_index,
                    None if stretches is None else (stretches.cos, stretches.sin),
                    rotation is None or rotation.is_neox_style,
                    0 if rotation is None else rotation.rotary_dim,
                )
                got = {name: touched(name) for name in names}
    except Exception as e:  # noqa: BLE001 - any failure keeps the generic path
        return f"self-check failed ({type(e).__name__}: {e})"
    for name in names:
        differ = bytes_differ(got[name], want[name])
        if differ:
            size = want[name].numel() * want[name].element_size()
            return f"self-check: {differ} of {size} bytes differ on {name}"
    return None


def choose_fused_layers(
    layers: dict[str, Any],
    kv_caches: dict[str, torch.Tensor],
    rotations: dict[str, RopeRotation | None],
    pool_dtype: torch.dtype,
    reference_write: ReferenceWrite,
    pool_key: dict[str, torch.Tensor],
    pool_value: dict[str, torch.Tensor],
) -> FusedLoadChoice:
    """Per layer: the fused kernel where available and its launch
    self-checked, else why not. The launches' tables point at the worker's
    pools `pool_key` / `pool_value`."""
    candidates = FusedLoadChoice()
    for name, kv_cache in kv_caches.items():
        paged = paged_layer(layers[name], kv_cache)
        if isinstance(paged, str):
            candidates.reasons[name] = paged
        else:
            candidates.layers[name] = paged
    choice = FusedLoadChoice(reasons=dict(candidates.reasons))
    for launch in group_fused_layers(candidates, pool_key, pool_value, rotations):
        reason = self_check_launch(
            launch, layers, kv_caches, pool_dtype, reference_write
        )
        if reason is None:
            choice.layers.update(zip(launch.names, launch.paged))
            choice.launches.append(launch)
        else:
            choice.reasons.update(dict.fromkeys(launch.names, reason))
    return choice
