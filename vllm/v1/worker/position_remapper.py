# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Move cached K/V rows from the chunk pool to a request's real positions.

A segment's K was stored after RoPE at positions stored_start.. . RoPE is a
rotation whose angle is linear in the position, so K at position p + d is
K at p rotated by the angle of d: the remapper gathers the rows, rotates K
by delta = real_start - stored_start and hands K/V to an injected
`write_rows` (the attention backend's own cache-write op in the engine; a
plain function in tests). V carries no position and is copied as is.

Numerics (docs/design/rotation-paths.md):
* the rotation is applied in fp32 and cast back to the cache dtype;
* cos/sin of each stretch's delta are computed on the host in float64 from
  vLLM's fp32 inverse frequencies, then cast to fp32 (fp32 angles would lose
  ~1e-2 rad at 1e5 positions), sent once per step, gathered per row on the
  device (`StretchCosSin`): nothing is read back from the device;
* the generic `rotate` rounds each product on its own (no fused multiply-add);
  on the CPU vLLM's own RoPE op rotates in place where a start-up check finds
  it bit-identical to `rotate`;
* YaRN and LongRoPE bake a magnitude (mscale) into their cos/sin, which the
  stored K carries already: the delta rotation is built from the frequencies
  alone (a pure rotation); the magnitude is still checked at start-up.

Supported: vLLM's default, linear (one factor), NTK, dynamic NTK (factor or
alpha), llama3, YaRN, DeepSeek's YaRN (MLA's `k_pe`) and LongRoPE ropes; neox
and GPT-J styles; partial rotary. Anything else (dual-chunk, M-RoPE, FoPE,
DeepSeek-V4's last-dims rope, ...) is refused with a ValueError naming it.
"""

import copy
import enum
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.model_executor.layers.rotary_embedding import (
    DeepseekScalingRotaryEmbedding,
    DynamicNTKAlphaRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding,
    LinearScalingRotaryEmbedding,
    Llama3RotaryEmbedding,
    NTKScalingRotaryEmbedding,
    Phi3LongRoPEScaledRotaryEmbedding,
    RotaryEmbedding,
    YaRNScalingRotaryEmbedding,
)
from vllm.v1.core.chunk_structures import ChunkLoadPlan

# (layer name, key rows [n, num_kv_heads, head_size], value rows, paged slot
# per row [n]) -> None: writes the rows into the layer's paged KV cache (the
# backend's own cache-write op).
WriteRows = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class _Frequencies:
    # fp32 angle per position step, one per rotated pair [rotary_dim // 2].
    inv_freq: torch.Tensor
    # Magnitude the rope's cos/sin cache carries (1.0 except YaRN/LongRoPE).
    magnitude: float
    # The rope's cos/sin cache in the layout [pos, cos | sin], and the row
    # of position 0 in it (LongRoPE keeps two caches back to back).
    cache: torch.Tensor
    cache_offset: int


def _plain(rope: RotaryEmbedding) -> _Frequencies:
    return _Frequencies(rope._compute_inv_freq(rope.base), 1.0, rope.cos_sin_cache, 0)


def _linear(rope: LinearScalingRotaryEmbedding) -> _Frequencies:
    if len(rope.scaling_factors) != 1:
        raise ValueError(
            "chunk cache supports linear RoPE scaling with one factor, got "
            f"{rope.scaling_factors} (multi-LoRA long-context scaling)"
        )
    # NOTE: vLLM divides the position by the factor; dividing the
    # frequency instead gives the same angle per position step.
    factor = float(rope.scaling_factors[0])
    inv_freq = rope._compute_inv_freq(rope.base) / factor
    return _Frequencies(inv_freq, 1.0, rope.cos_sin_cache, 0)


def _dynamic_ntk(rope: DynamicNTKScalingRotaryEmbedding) -> _Frequencies:
    # NOTE: vLLM's "dynamic" NTK fixes the enlarged base at init, so the angle
    # stays linear in the position (its _compute_cos_sin_cache's formula).
    ratio = rope.scaling_factor * rope.max_position_embeddings
    ratio = ratio / rope.max_trained_positions - (rope.scaling_factor - 1)
    base = rope.base * ratio ** (rope.rotary_dim / (rope.rotary_dim - 2))
    return _Frequencies(rope._compute_inv_freq(base), 1.0, rope.cos_sin_cache, 0)


def _dynamic_ntk_alpha(rope: DynamicNTKAlphaRotaryEmbedding) -> _Frequencies:
    exponent = rope.rotary_dim / (rope.rotary_dim - 2)
    base = rope.base * rope.scaling_alpha**exponent
    return _Frequencies(rope._compute_inv_freq(base), 1.0, rope.cos_sin_cache, 0)


def _yarn(
    rope: YaRNScalingRotaryEmbedding | DeepseekScalingRotaryEmbedding,
) -> _Frequencies:
    # NOTE: DeepSeek's YaRN (MLA's k_pe, V3.2's indexer keys) has the same
    # rule: mscale / mscale_all_dim * attn_factor baked into its cos/sin.
    inv_freq = rope._compute_inv_freq(rope.scaling_factor)
    return _Frequencies(inv_freq, float(rope.mscale), rope.cos_sin_cache, 0)


def _longrope(rope: Phi3LongRoPEScaledRotaryEmbedding) -> _Frequencies:
    # NOTE: vLLM picks the long or short factors once per engine (from
    # max_model_len), so one request never mixes the two.
    if rope.use_long_rope:
        inv_freq = rope._compute_inv_freq(rope.long_factor)
        magnitude, offset = rope.long_mscale, rope.original_max_position_embeddings
    else:
        inv_freq = rope._compute_inv_freq(rope.short_factor)
        magnitude, offset = rope.short_mscale, 0
    return _Frequencies(
        inv_freq, float(magnitude), rope.long_short_cos_sin_cache, offset
    )


# Exact types only: subclasses (M-RoPE, FoPE, Gemma4, XD-RoPE...) change the
# angle rule and are refused, not guessed; a platform plugin adds its own
# subclasses one exact type at a time (`register_rope_rule`).
_FREQUENCY_RULES: dict[type, Callable] = {
    RotaryEmbedding: _plain,
    NTKScalingRotaryEmbedding: _plain,
    Llama3RotaryEmbedding: _plain,
    LinearScalingRotaryEmbedding: _linear,
    DynamicNTKScalingRotaryEmbedding: _dynamic_ntk,
    DynamicNTKAlphaRotaryEmbedding: _dynamic_ntk_alpha,
    YaRNScalingRotaryEmbedding: _yarn,
    DeepseekScalingRotaryEmbedding: _yarn,
    Phi3LongRoPEScaledRotaryEmbedding: _longrope,
}

# Rope types whose forward stores keys with another pairing than their
# `is_neox_style` says: type -> (rope -> True for pairs (i, i + half), False
# for (2i, 2i + 1)). Absent: `is_neox_style`.
_STORED_PAIRING: dict[type, Callable[[torch.nn.Module], bool]] = {}


def yarn_from_inv_freq_buffer(rope: torch.nn.Module) -> _Frequencies:
    """YaRN whose rope keeps the inverse frequencies of its cos/sin cache in an
    `inv_freq` buffer, magnitude `mscale` (vllm-ascend's DeepSeek YaRN: its own
    fp32 code ignores `extrapolation_factor`, so vLLM's formula would differ)."""
    return _Frequencies(
        rope.inv_freq.detach().float().cpu(), float(rope.mscale), rope.cos_sin_cache, 0
    )


def register_rope_rule(
    rope_type: type,
    rule: type | Callable[[torch.nn.Module], _Frequencies],
    stored_neox_style: Callable[[torch.nn.Module], bool] | None = None,
) -> None:
    """Accept the exact type `rope_type` (not its subclasses) with `rule`: an
    accepted type whose angle rule it keeps, or a function of the rope
    (`yarn_from_inv_freq_buffer`); for a platform plugin's rope classes
    (vllm_ascend/distributed/chunk_cache_npu.py). The start-up self-check
    (`_check_against_cache`) still compares the rule with the rope's cache.
    `stored_neox_style`: the keys' pairing as the rope's forward leaves them,
    where it is not the rope's `is_neox_style`."""
    if not (isinstance(rope_type, type) and issubclass(rope_type, torch.nn.Module)):
        raise TypeError(f"register_rope_rule takes a rope class, got {rope_type!r}")
    if isinstance(rule, type):
        if rule not in _FREQUENCY_RULES:
            raise ValueError(f"no frequency rule for {rule.__name__} to reuse")
        rule = _FREQUENCY_RULES[rule]
    _FREQUENCY_RULES[rope_type] = rule
    if stored_neox_style is None:
        _STORED_PAIRING.pop(rope_type, None)
    else:
        _STORED_PAIRING[rope_type] = stored_neox_style


class Rounding(enum.Enum):
    """How `RopeRotation.rotate` rounds `x1*cos - x2*sin` (and the `+` twin):
    vLLM's CPU RoPE op rounds either way by build and rope style, so the CPU
    self-check picks the one it reproduces (docs/design/rotation-paths.md)."""

    # Each product rounded, then add/subtract: no fused multiply-add.
    PRODUCTS = "rounded products"
    # mul, then addcmul_: fused where PyTorch's CPU kernel fuses.
    ADDCMUL = "addcmul"


def _frequencies(rope: torch.nn.Module) -> _Frequencies:
    rule = _FREQUENCY_RULES.get(type(rope))
    if rule is None:
        raise ValueError(
            f"chunk cache cannot re-position keys of RoPE type "
            f"{type(rope).__name__}: only RoPE whose angle is linear in "
            "the position is supported (default, linear, ntk, dynamic, "
            "llama3, yarn, deepseek_yarn, longrope; a platform's own "
            "subclasses only where its plugin registered them)"
        )
    return rule(rope)


def _stored_neox_style(rope: torch.nn.Module) -> bool:
    # The stored keys' pairing: the rope's, unless registered otherwise.
    pairing = _STORED_PAIRING.get(type(rope))
    return bool(
        pairing(rope) if pairing is not None else getattr(rope, "is_neox_style", True)
    )


def rotation_identity(rope: torch.nn.Module) -> dict[str, object]:
    """What the keys this rope rotated depend on, as vLLM built it: the rule's
    fp32 inverse frequencies (digest), magnitude, row of position 0, dims,
    pairing and cache dtype; two engines whose stored K could differ get
    different identities. NOTE: not the HF rope fields: LongRoPE picks its long
    or short factors from --max-model-len. ValueError for a refused rope."""
    freqs = _frequencies(rope)
    inv_freq = freqs.inv_freq.detach().to(torch.float32).cpu().contiguous()
    digest = hashlib.blake2b(inv_freq.numpy().tobytes(), digest_size=16)
    return {
        "type": type(rope).__name__,
        "head_size": int(rope.head_size),
        "rotary_dim": int(rope.rotary_dim),
        "neox": _stored_neox_style(rope),
        "inv_freq": digest.hexdigest(),
        # float.hex: exact, a repr of a rounded print could merge two magnitudes.
        "magnitude": float(freqs.magnitude).hex(),
        "cache_offset": int(freqs.cache_offset),
        "cache_dtype": str(freqs.cache.dtype),
    }


class RopeRotation:
    """Rotates post-RoPE keys by a position delta, for one rope object."""

    def __init__(self, rope: torch.nn.Module, use_cpu_kernel: bool = True):
        freqs = _frequencies(rope)
        self.head_size: int = rope.head_size
        self.rotary_dim: int = rope.rotary_dim
        self.is_neox_style: bool = _stored_neox_style(rope)
        # On the host only: a device copy kept from start-up would live in the
        # KV-cache memory pool, which a sleep discards.
        self.inv_freq = freqs.inv_freq.to(torch.float32).cpu()
        # What a step's cos/sin depend on: rotations with the same
        # frequencies (with_pairing copies, layers of one rope) share them.
        self.frequency_key: bytes = self.inv_freq.numpy().tobytes()
        self.magnitude = freqs.magnitude
        _check_against_cache(self, freqs, type(rope).__name__)
        # vLLM's CPU RoPE op (rotate_in_place): None until the first use
        # checks it against rotate(); False disables it; and why (start-up log).
        self._cpu_kernel: bool | None = None if use_cpu_kernel else False
        self._cpu_kernel_reason = "" if use_cpu_kernel else "disabled by the caller"
        # rotate()'s rounding: the CPU self-check may pick the op's.
        self.rounding = Rounding.PRODUCTS
        # (deltas, row -> table index, table, deltas' version) of the last
        # rows rotated in place (one load plan per step, for every layer).
        self._delta_table: (
            tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None
        ) = None

    def with_pairing(self, neox_style: bool) -> "RopeRotation":
        """This rotation for rows paired otherwise (halves if `neox_style`,
        adjacent values if not): a copy with its own delta table, for a reader
        that re-lays the rows (vllm-ascend's MLA: cache_writers.LatentWriter)."""
        if neox_style == self.is_neox_style:
            return self
        other = copy.copy(self)
        other.is_neox_style = neox_style
        other._delta_table = None
        # The CPU op is checked per pairing: check it again on first use.
        if other._cpu_kernel is not False:
            other._cpu_kernel = None
            other.rounding = Rounding.PRODUCTS
        return other

    def cos_sin(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [n, rotary_dim // 2] of each delta's angle, of unit
        magnitude (the rope's mscale is not applied: module doc)."""
        angles = deltas.to("cpu", torch.float64)[:, None] * self.inv_freq.double()
        return angles.cos().float(), angles.sin().float()

    def cos_sin_rows(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [n, 1, rotary_dim // 2] of each row's delta, on the
        deltas' device. NOTE: reads device deltas back: tests and tools only
        (the worker uses `stretch_cos_sin`)."""
        cos, sin = self.cos_sin(deltas.cpu())
        return cos.to(deltas.device)[:, None], sin.to(deltas.device)[:, None]

    def stretch_cos_sin(
        self, stretch_deltas: torch.Tensor, device: torch.device
    ) -> "StretchCosSin":
        """fp32 cos/sin of each stretch's delta (`stretch_deltas` [s], on the
        host), formed on the host and copied to `device` in one transfer each."""
        if stretch_deltas.device.type != "cpu":
            raise ValueError("stretch deltas must be the host's (no device read-back)")
        cos, sin = self.cos_sin(stretch_deltas)
        if device.type != "cpu":
            cos = cos.pin_memory().to(device, non_blocking=True)
            sin = sin.pin_memory().to(device, non_blocking=True)
        return StretchCosSin(cos, sin)

    def rotate(
        self,
        key: torch.Tensor,
        deltas: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`key` [n, heads, head_size] rotated row-wise by `deltas` [n] into
        `out` (key's shape and dtype, not overlapping it; None: a new tensor).
        `cos_sin`: each row's (`cos_sin_rows`), if computed already."""
        # [n, 1, rotary_dim // 2]: broadcast over heads.
        cos, sin = self.cos_sin_rows(deltas) if cos_sin is None else cos_sin
        out = torch.empty_like(key) if out is None else out
        half = self.rotary_dim // 2
        target = out[..., : self.rotary_dim]
        if key.dtype == torch.float32:
            source, result = key[..., : self.rotary_dim], target
        else:
            # Rotate in fp32, cast once into `out`.
            source = key[..., : self.rotary_dim].float()
            result = torch.empty_like(source)
        # Pair (x1[i], x2[i]) rotates by angle i: halves in neox style,
        # adjacent elements in GPT-J style (views: o1, o2 write `result`).
        pairing, axis = ((2, half), -2) if self.is_neox_style else ((half, 2), -1)
        x1, x2 = source.unflatten(-1, pairing).unbind(axis)
        o1, o2 = result.unflatten(-1, pairing).unbind(axis)
        if self.rounding is Rounding.ADDCMUL:
            # fma(-x2, sin, x1 * cos) where PyTorch's CPU kernel fuses (x86).
            torch.mul(x1, cos, out=o1)
            o1.addcmul_(x2, sin, value=-1)
            torch.mul(x2, cos, out=o2)
            o2.addcmul_(x1, sin)
        else:
            # Each product rounded, then one add: the same bits on any device.
            product = torch.mul(x2, sin)
            torch.mul(x1, cos, out=o1)
            o1.sub_(product)
            torch.mul(x1, sin, out=product)
            torch.mul(x2, cos, out=o2)
            o2.add_(product)
        if result is not target:
            target.copy_(result)
        if self.rotary_dim < self.head_size:
            out[..., self.rotary_dim :].copy_(key[..., self.rotary_dim :])
        return out

    # ------------------------------------------------ CPU in-place kernel

    def rotates_in_place(self, device: torch.device) -> bool:
        """Whether `rotate_in_place` is used on `device`: on the CPU, where
        vLLM's CPU RoPE op reproduces `rotate` bit for bit (one vectorised pass
        instead of four: docs/design/rotation-paths.md)."""
        if device.type != "cpu":
            return False
        if self._cpu_kernel is None:
            self._cpu_kernel = self._cpu_kernel_matches()
        return self._cpu_kernel

    def describe_path(self, device: torch.device) -> str:
        """Which rotation path runs on `device`, and why (start-up log)."""
        if device.type != "cpu":
            return f"generic fp32 rotation on {device.type}"
        if self.rotates_in_place(device):
            return (
                "vLLM's CPU RoPE op in place (checked bit-identical to the "
                f"generic rotation with {self.rounding.value} on this CPU)"
            )
        return f"generic fp32 rotation: {self._cpu_kernel_reason}"

    def rotate_in_place(self, key: torch.Tensor, deltas: torch.Tensor) -> None:
        """Rotates `key` [n, heads, head_size] (fp32, contiguous, CPU) by
        `deltas` [n] in place with vLLM's CPU RoPE op, whose "positions" index
        a table of cos/sin per distinct delta."""
        index, table = self._table_for(deltas)
        self.rotate_in_place_indexed(key, index, table)

    def rotate_in_place_indexed(
        self, key: torch.Tensor, index: torch.Tensor, table: torch.Tensor
    ) -> None:
        """`rotate_in_place` with each row's entry `index` [n] (int64) of a
        cos/sin `table` [entries, rotary_dim] (`StretchCosSin.op_table`)."""
        torch.ops._C.rotary_embedding(
            index,
            key.view(key.shape[0], -1),
            None,
            self.head_size,
            table,
            self.is_neox_style,
        )

    def _table_for(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: inference-mode tensors have no version counter: keyed by
        # identity alone (the worker's deltas are new each step, never written).
        version = -1 if deltas.is_inference() else deltas._version
        cached = self._delta_table
        if cached is not None and cached[0] is deltas and cached[3] == version:
            return cached[1], cached[2]
        distinct, index = torch.unique(deltas.cpu(), return_inverse=True)
        table = StretchCosSin(*self.cos_sin(distinct)).op_table()
        # Holding `deltas` keeps its id from being reused by another tensor.
        self._delta_table = (deltas, index.to(torch.int64), table, version)
        return self._delta_table[1], table

    def _cpu_kernel_matches(self) -> bool:
        """Whether the op is there and equals rotate() bit for bit on a sample
        with one of its roundings (kept); else the generic path is kept."""
        try:
            from vllm import _custom_ops  # noqa: F401  (loads vLLM's _C ops)

            generator = torch.Generator().manual_seed(0)
            sample = 4 * torch.randn(64, 2, self.head_size, generator=generator)
            deltas = torch.arange(64, dtype=torch.int64).remainder(8) * 9973 - 31000
            in_place = sample.clone()
            self.rotate_in_place(in_place, deltas)
            differ = {}
            for rounding in Rounding:
                self.rounding = rounding
                differ[rounding] = int((self.rotate(sample, deltas) != in_place).sum())
                if differ[rounding] == 0:
                    return True
            self._cpu_kernel_reason = (
                "vLLM's CPU RoPE op differs from it in the last bit on "
                + ", ".join(f"{n} ({r.value})" for r, n in differ.items())
                + f" of {sample.numel()} sampled values on this CPU "
                "(docs/design/rotation-paths.md)"
            )
        except Exception as e:  # op missing or without a CPU kernel: generic path
            self._cpu_kernel_reason = f"vLLM's CPU RoPE op is unavailable ({e})"
        finally:
            self._delta_table = None
        self.rounding = Rounding.PRODUCTS
        return False


def _check_against_cache(
    rotation: RopeRotation, freqs: _Frequencies, rope_name: str
) -> None:
    """Refuse frequencies that do not reproduce the rope's cache (row p must
    be magnitude * [cos(p f), sin(p f)]): guards the rules against upstream."""
    cache = freqs.cache.detach().float().cpu()
    usable = cache.shape[0] - freqs.cache_offset
    positions = torch.tensor([p for p in (0, 1, 7, 100) if p < usable])
    cos, sin = rotation.cos_sin(positions)
    expected = torch.cat((cos, sin), dim=-1) * freqs.magnitude
    actual = cache[freqs.cache_offset + positions]
    tolerance = 2e-2 if freqs.cache.dtype in (torch.bfloat16, torch.float16) else 1e-4
    if not torch.allclose(actual, expected, atol=tolerance * max(1.0, freqs.magnitude)):
        raise ValueError(
            f"chunk cache: RoPE frequencies derived for {rope_name} do not "
            "match the rope's own cos/sin cache (vLLM changed its formula?)"
        )


@dataclass
class StretchCosSin:
    """fp32 cos/sin [num_stretches, rotary_dim // 2] of a step's stretch deltas
    on the rows' device, once per step and set of frequencies, for every layer."""

    cos: torch.Tensor
    sin: torch.Tensor
    # (stretch index, its rows' cos/sin) of the last gather (one per piece).
    _rows: tuple | None = None
    _op_table: torch.Tensor | None = None

    def rows(self, stretch_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's cos/sin [n, 1, rotary_dim // 2], gathered on the device
        by `stretch_index` [n]."""
        if self._rows is None or self._rows[0] is not stretch_index:
            self._rows = (
                stretch_index,
                (self.cos[stretch_index][:, None], self.sin[stretch_index][:, None]),
            )
        return self._rows[1]

    def op_table(self) -> torch.Tensor:
        """[num_stretches, rotary_dim]: vLLM's RoPE op's cache layout (cos | sin)."""
        if self._op_table is None:
            self._op_table = torch.cat((self.cos, self.sin), dim=-1).contiguous()
        return self._op_table


@dataclass(frozen=True)
class RemapRows:
    """Row-level instruction for one layer (same for every layer)."""

    # Pool rows to read [n], paged slots to write [n], deltas (real - stored).
    src_rows: torch.Tensor
    dst_slots: torch.Tensor
    deltas: torch.Tensor
    # For `StretchCosSin`: each row's stretch [n] (on the device), and each
    # stretch's delta (on the host).
    stretch_index: torch.Tensor | None = None
    stretch_deltas: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.src_rows.shape[0]

    def pieces(self, max_rows: int) -> list["RemapRows"]:
        """The rows in order, in pieces of at most `max_rows` (views)."""
        index, starts = self.stretch_index, range(0, self.num_rows, max_rows)
        return [
            RemapRows(
                self.src_rows[s],
                self.dst_slots[s],
                self.deltas[s],
                None if index is None else index[s],
                self.stretch_deltas,
            )
            for s in (slice(i, i + max_rows) for i in starts)
        ]

    @classmethod
    def from_load_plan(
        cls, plan: ChunkLoadPlan, pool_block_size: int, dst_slots: torch.Tensor
    ) -> "RemapRows":
        """Expand a plan (`dst_slots[p]`: position p's paged slot) through the
        connector's `LoadRows.expand`, every position a block of one slot."""
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.metadata import (
            LoadRows,
            RequestLoad,
            SegmentStretch,
        )

        for seg in plan.segments:
            if seg.dst_start + seg.row_end > dst_slots.shape[0]:
                raise ValueError(
                    f"segment {seg.segment_index} ends at position "
                    f"{seg.dst_start + seg.row_end} beyond the "
                    f"{dst_slots.shape[0]} slots given"
                )
        load = RequestLoad(
            block_ids=tuple(dst_slots.tolist()),
            stretches=tuple(SegmentStretch.of(s) for s in plan.segments),
        )
        rows = LoadRows.expand([load], pool_block_size, 1, dst_slots.device)
        return cls(
            src_rows=rows.src_rows, dst_slots=rows.dst_slots, deltas=rows.deltas.cpu()
        )


class RemapScratch:
    """Gather/rotate buffers reused by every layer and step.

    NOTE: fresh multi-MB tensors per layer cost more than the remap itself
    (page faults: 107 ms against 41 ms, 30 layers x 3,100 rows on the CPU).
    Reuse across layers is safe: the cache-write op consumes the rows before
    the next layer overwrites them (in stream order on a device).

    With `max_rows` (setup.load_scratch_rows) each buffer is allocated once at
    that size by `prepare` and never grows, so the pool's carve-out counts it
    (setup.load_scratch_bytes); callers pass at most that many rows
    (`RemapRows.pieces`). Without it (tests, tools) buffers grow."""

    # Buffers a load takes per row, by model kind: (role, in fp32 (else the
    # pool's dtype; fp32 ones only for a 16-bit pool), part of the row).
    # Standard attention (the generic path's worst case): parts "k", "v".
    STANDARD = (
        ("key", False, "k"),
        ("value", False, "v"),
        ("rotated", False, "k"),
        ("key32", True, "k"),
        ("rotated32", True, "k"),
    )
    # MLA: kv_c ("c") and k_pe ("r") gathered apart, contiguous as the latent
    # writers take them, k_pe rotated through fp32.
    LATENT = (
        ("kv_c", False, "c"),
        ("k_pe", False, "r"),
        ("k_pe32", True, "r"),
        ("k_pe_rotated32", True, "r"),
        ("k_pe_rotated", False, "r"),
    )

    def __init__(self, max_rows: int | None = None) -> None:
        self.max_rows = max_rows
        self._buffers: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def _needed(fp32: bool, dtype: torch.dtype) -> bool:
        return not (fp32 and dtype == torch.float32)

    @classmethod
    def row_bytes(
        cls, roles: tuple, elements: dict[str, int], dtype: torch.dtype
    ) -> int:
        """Bytes per row of the buffers `roles` for parts of `elements` values."""
        return sum(
            elements[part] * (4 if fp32 else dtype.itemsize)
            for _, fp32, part in roles
            if cls._needed(fp32, dtype)
        )

    @classmethod
    def bytes_per_row(
        cls, key_elements: int, value_elements: int, dtype: torch.dtype
    ) -> int:
        """Bytes per row of every buffer `remap_layer` may take, for one
        K/V shape and pool dtype (the fp32 ones only for a 16-bit pool)."""
        return cls.row_bytes(
            cls.STANDARD, {"k": key_elements, "v": value_elements}, dtype
        )

    def prepare(
        self,
        roles: tuple,
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Allocate now the buffers of `roles` (parts of `shapes` per row) at
        `max_rows` rows, as `take` will ask for them."""
        assert self.max_rows is not None, "prepare needs max_rows"
        for role, fp32, part in roles:
            if not self._needed(fp32, dtype):
                continue
            buffer_dtype = torch.float32 if fp32 else dtype
            key = (role, buffer_dtype, device, tuple(shapes[part]))
            if key not in self._buffers:
                self._buffers[key] = torch.empty(
                    (self.max_rows, *shapes[part]), dtype=buffer_dtype, device=device
                )

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def take(
        self,
        role: str,
        like: torch.Tensor,
        num_rows: int,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """A [num_rows, *like.shape[1:]] buffer on like's device, of `dtype`
        (default: like's)."""
        dtype = dtype or like.dtype
        key = (role, dtype, like.device, tuple(like.shape[1:]))
        buffer = self._buffers.get(key)
        if self.max_rows is not None and num_rows > self.max_rows:
            raise ValueError(
                f"{num_rows} rows exceed the load buffers' {self.max_rows}: "
                "pass them in pieces (RemapRows.pieces)"
            )
        num_alloc = num_rows if self.max_rows is None else self.max_rows
        if buffer is None or buffer.shape[0] < num_rows:
            buffer = torch.empty(
                (num_alloc, *like.shape[1:]), dtype=dtype, device=like.device
            )
            self._buffers[key] = buffer
        return buffer[:num_rows]

    def rotated(
        self,
        rotate: Callable[[torch.Tensor, torch.Tensor], object],
        source: torch.Tensor,
        out: torch.Tensor,
        roles: tuple[str, str],
    ) -> torch.Tensor:
        """`out` after `rotate(rows, into)` ran in fp32 (module doc): on `source`
        itself if it is fp32, else through the fp32 buffers `roles` (the rows'
        copy, the result), cast back once into `out`."""
        if source.dtype == torch.float32:
            rotate(source, out)
            return out
        num_rows = source.shape[0]
        source32 = self.take(roles[0], source, num_rows, torch.float32).copy_(source)
        result32 = self.take(roles[1], source, num_rows, torch.float32)
        rotate(source32, result32)
        return out.copy_(result32)


class PositionRemapper:
    """Gathers pool rows, re-positions K, writes K/V through `write_rows`."""

    def __init__(
        self,
        rotation: RopeRotation | None,
        write_rows: WriteRows,
        scratch: RemapScratch | None = None,
    ):
        # None: the model has no RoPE (or the layer does not use it): copy.
        self.rotation = rotation
        self.write_rows = write_rows
        # Shared by all layers of a worker (one set of buffers).
        self.scratch = scratch if scratch is not None else RemapScratch()

    def remap_layer(
        self,
        layer_name: str,
        pool_key: torch.Tensor,
        pool_value: torch.Tensor,
        rows: RemapRows,
        stretches: StretchCosSin | None = None,
    ) -> None:
        """Gather, rotate (a zero delta rotates by cos 1, sin 0: exact), write.
        `pool_key`/`pool_value`: contiguous [num_pool_rows, num_kv_heads,
        head_size] on the device of `rows`. `stretches`: the step's cos/sin per
        stretch; without it (tests, tools) the rows' deltas are read back."""
        num_rows = rows.src_rows.shape[0]
        key = self.scratch.take("key", pool_key, num_rows)
        value = self.scratch.take("value", pool_value, num_rows)
        rotation = self.rotation
        # NOTE: rows flattened to 2-D: index_select copies whole rows then
        # (~20% faster on CPU than the 3-D gather). V needs no rotation.
        for pool, out in ((pool_value, value), (pool_key, key)):
            torch.index_select(pool.flatten(1), 0, rows.src_rows, out=out.flatten(1))
        if rotation is not None and rotation.rotates_in_place(key.device):
            # CPU: fp32 copy, vLLM's op in place, cast back (rotation-paths.md).
            if stretches is not None and rows.stretch_index is not None:
                index, table = rows.stretch_index, stretches.op_table()
            else:
                index, table = rotation._table_for(rows.deltas)
            key32 = key
            if key.dtype != torch.float32:
                key32 = self.scratch.take("key32", key, num_rows, torch.float32)
                key32.copy_(key)
            rotation.rotate_in_place_indexed(key32, index, table)
            if key32 is not key:
                key.copy_(key32)
        elif rotation is not None:
            cos_sin = (
                None
                if stretches is None or rows.stretch_index is None
                else stretches.rows(rows.stretch_index)
            )
            rotated = self.scratch.take("rotated", pool_key, num_rows)
            key = self.scratch.rotated(
                lambda rows32, into: rotation.rotate(
                    rows32, rows.deltas, cos_sin, out=into
                ),
                key,
                rotated,
                ("key32", "rotated32"),
            )
        self.write_rows(layer_name, key, value, rows.dst_slots)
