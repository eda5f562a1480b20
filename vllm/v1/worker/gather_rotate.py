# SPDX-License-Identifier: Apache-2.0
"""K's CPU load in one pass: gather, fp32 rotation, cast back (issue 52).

On the CPU the remapper loads K in passes over the rows: `index_select` from
the pool, a cast to fp32, vLLM's RoPE op in place, a cast back
(`position_remapper.load_key_passes`). `gather_rotate.c` does the same per
row in one pass. It is compiled when the CPU wheel is built
(tools/forktool/cpu_kernel.py: one body per ISA of vLLM's CPU build, picked
at the first call) and shipped next to this file: nothing is compiled, and
no cache directory is read or written, on the serving machine (issue 59).

A remapper uses it only for a rotation and dtype where a start-up check finds
its bytes equal to the passes' on a sample holding subnormal, large, NaN and
Inf values: the passes' numerics are the ones the exactness suites hold, so
the kernel changes time, not bits. Any failure to find, load or check it
keeps the passes and the start-up log says why (worker.py).

NaN and Inf: the kernel reports a call that met one, and such a call is
loaded by the passes instead (torch's casts write NaN patterns no formula in
the kernel can promise to match).

Threads: the rows are split over OpenMP threads of torch's own runtime (the
libgomp torch loaded, made global before the library is loaded: its GOMP_*
symbols are left undefined at link time), so there is one runtime and one
thread pool; a process whose torch holds no libgomp gets the serial library.

NOTE: measured with `benchmarks/bench_cpu_load.py` (docs/benchmarks.md,
issue 52 fifth pass; docs/design/rotation-paths.md for the threads). V needs
no rotation: its gather stays `index_select`, and the write stays the
attention backend's own op, whose cache layout depends on the ISA.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm.v1.worker.position_remapper import RopeRotation, Rounding, load_key_passes

HERE = Path(__file__).parent
# Built by tools/forktool/cpu_kernel.py into the wheel.
LIBRARY = HERE / "_gather_rotate.so"
SERIAL_LIBRARY = HERE / "_gather_rotate_serial.so"
# Their sha256 (cpu_kernel.py), checked before a library is loaded.
DIGESTS = HERE / "_gather_rotate.sha256.json"
# The interface version of gather_rotate.c (GATHER_ROTATE_ABI).
ABI = 2
_ENTRIES = {
    torch.bfloat16: "gather_rotate_bf16",
    torch.float16: "gather_rotate_f16",
    torch.float32: "gather_rotate_f32",
}
_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# The entries' return: a call that met Inf or NaN.
_NONFINITE = -1


class LoadError(RuntimeError):
    """The kernel could not be found, loaded or checked here (the message
    says why); the passes are kept."""


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _address(handle: ctypes.CDLL, symbol: str) -> int | None:
    try:
        return ctypes.cast(getattr(handle, symbol), ctypes.c_void_p).value
    except AttributeError:
        return None


def torch_openmp_runtime() -> str | None:
    """The file of the OpenMP runtime torch's own CPU code calls (the one
    `GOMP_parallel` resolves to from libtorch_cpu), or None.

    NOTE: PyPI's torch loads its own copy (torch/lib/libgomp.so.1, or a
    renamed libgomp-<hash>.so in torch.libs for other builds), and the
    process may hold others (sentencepiece ships its own libgomp): a library
    linked to libgomp by name could bind to another runtime, with threads of
    its own. Read from the dynamic loader: libtorch_cpu's binding, not a name."""
    try:
        with open("/proc/self/maps") as f:
            libtorch = sorted(
                {
                    line.split(None, 5)[5].strip()
                    for line in f
                    if "libtorch_cpu" in line and len(line.split(None, 5)) == 6
                }
            )
        if not libtorch:
            return None
        address = _address(
            ctypes.CDLL(libtorch[0], mode=os.RTLD_NOLOAD), "GOMP_parallel"
        )
        if address is None:
            return None
        info = _DlInfo()
        libdl = ctypes.CDLL(None)
        libdl.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        if not libdl.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
            return None
        return info.dli_fname.decode()
    except OSError:
        return None


def _bind_openmp(runtime: str) -> str | None:
    """Makes `runtime` global so the threaded library's GOMP_* symbols bind
    to it; None if they would (the global definition is that runtime's),
    else why not."""
    try:
        handle = ctypes.CDLL(runtime, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except OSError as e:
        return f"{Path(runtime).name} cannot be made global ({e})"
    ours, bound = (
        _address(handle, "GOMP_parallel"),
        _address(ctypes.CDLL(None), "GOMP_parallel"),
    )
    if ours is None or ours != bound:
        return (
            f"GOMP_parallel would bind to another OpenMP runtime than torch's "
            f"{Path(runtime).name}"
        )
    return None


def _check_digest(library: Path) -> None:
    """The library's bytes are the ones the wheel was built with.

    NOTE: before dlopen, not after: the loader maps a truncated library's
    segments past the end of its file, and the first touch of one is a
    SIGBUS that kills the process (seen in this module's tests), not an
    error to catch."""
    digests_file = library.with_name(DIGESTS.name)
    try:
        expected = json.loads(digests_file.read_text())[library.name]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LoadError(
            f"no digest of {library.name} in {digests_file} ({type(e).__name__}: {e})"
        ) from None
    actual = hashlib.sha256(library.read_bytes()).hexdigest()
    if actual != expected:
        raise LoadError(
            f"{library.name} is not the file the wheel was built with "
            f"(sha256 {actual[:16]}..., expected {str(expected)[:16]}...; "
            "truncated or replaced)"
        )


@dataclass(frozen=True)
class _Shape:
    """What a self-check's verdict holds for."""

    frequencies: bytes
    neox: bool
    rotary_dim: int
    head_size: int
    rounding: Rounding
    dtype: torch.dtype


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, past the last byte) of the memory `t` may touch."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


class GatherRotate:
    """The loaded kernel, and the rotations it was checked to serve."""

    def __init__(self, library: Path, openmp_runtime: str | None = None):
        """Loads `library`; any failure is a LoadError that says why."""
        self.library = library
        self.openmp_runtime = openmp_runtime
        try:
            if not library.is_file():
                raise LoadError(
                    f"{library} not found (a wheel built without the CPU kernel?)"
                )
            _check_digest(library)
            lib = ctypes.CDLL(str(library))
            lib.gather_rotate_abi.restype = _INT
            abi = lib.gather_rotate_abi()
            if abi != ABI:
                raise LoadError(
                    f"{library.name} has interface {abi}, this vLLM needs {ABI}"
                )
            lib.gather_rotate_isa.restype = ctypes.c_char_p
            self.isa: str = lib.gather_rotate_isa().decode()
            lib.gather_rotate_use_isa.restype = _INT
            lib.gather_rotate_use_isa.argtypes = [_INT]
            self._lib = lib
            self._entries = {}
            for dtype, name in _ENTRIES.items():
                entry = getattr(lib, name)
                entry.restype = _I
                entry.argtypes = [
                    _P,
                    _I,
                    _P,
                    _P,
                    _I,
                    _P,
                    _I,
                    _I,
                    _I,
                    _I,
                    _INT,
                    _INT,
                    _INT,
                    _P,
                ]
                self._entries[dtype] = entry
        except LoadError:
            raise
        except (
            Exception
        ) as e:  # OSError (missing, truncated), AttributeError (symbol), ...
            raise LoadError(
                f"cannot load {library.name}: {type(e).__name__}: {e}"
            ) from None
        self._verdicts: dict[_Shape, str | None] = {}

    @classmethod
    def load(cls, directory: Path | None = None) -> GatherRotate:
        """The library shipped in `directory` (default: next to this file):
        threaded on torch's OpenMP runtime where the process holds one, else
        the serial one. Never compiles, never touches a cache directory;
        LoadError says why not."""
        directory = HERE if directory is None else Path(directory)
        runtime = torch_openmp_runtime()
        # NOTE: the threaded library only where its GOMP_* symbols bind to
        # torch's runtime (made global here): one runtime, one thread pool.
        if runtime is None or _bind_openmp(runtime) is not None:
            return cls(directory / SERIAL_LIBRARY.name)
        return cls(directory / LIBRARY.name, runtime)

    def describe(self) -> str:
        threads = (
            f"threads of {Path(self.openmp_runtime).name}"
            if self.openmp_runtime
            else "one thread"
        )
        return f"{self.library.name}, {self.isa} body, {threads}"

    def use_isa(self, which: int) -> bool:
        """Tests: run the body `which` (0 baseline, 1 AVX2, 2 AVX-512) if this
        CPU has its ISA; -1 goes back to the CPU's pick."""
        return bool(self._lib.gather_rotate_use_isa(which))

    @staticmethod
    def _checked(
        pool: torch.Tensor,
        src_rows: torch.Tensor,
        index: torch.Tensor,
        table: torch.Tensor,
        rotation: RopeRotation,
        out: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every shape, dtype, device, length and overlap the C code relies
        on, checked before a pointer reaches it: ValueError naming what is
        wrong. Returns src_rows and index as contiguous int64."""
        names = {
            "pool": pool,
            "src_rows": src_rows,
            "index": index,
            "table": table,
            "out": out,
        }
        for name, t in names.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(
                    f"gather_rotate: {name} is not a tensor ({type(t).__name__})"
                )
            if t.device.type != "cpu":
                raise ValueError(f"gather_rotate: {name} is on {t.device}, not the CPU")
        if pool.dim() != 3 or out.dim() != 3:
            raise ValueError(
                f"gather_rotate: pool {tuple(pool.shape)} and out "
                f"{tuple(out.shape)} must be [rows, heads, head_size]"
            )
        if pool.dtype not in _ENTRIES:
            raise ValueError(
                f"gather_rotate: pool dtype {pool.dtype} is not supported "
                f"({', '.join(map(str, _ENTRIES))})"
            )
        if out.dtype != pool.dtype:
            raise ValueError(
                f"gather_rotate: out dtype {out.dtype} differs from the "
                f"pool's {pool.dtype}"
            )
        if not (pool.is_contiguous() and out.is_contiguous()):
            raise ValueError("gather_rotate: pool and out must be contiguous")
        n, heads, head_size = out.shape
        if tuple(pool.shape[1:]) != (heads, head_size):
            raise ValueError(
                f"gather_rotate: pool rows {tuple(pool.shape[1:])} and out rows "
                f"{(heads, head_size)} differ in row shape"
            )
        if head_size != rotation.head_size:
            raise ValueError(
                f"gather_rotate: head_size {head_size} is not the rotation's "
                f"{rotation.head_size}"
            )
        rotary_dim = rotation.rotary_dim
        if not (0 < rotary_dim <= head_size and rotary_dim % 2 == 0):
            raise ValueError(
                f"gather_rotate: rotary_dim {rotary_dim} must be even and in "
                f"(0, head_size {head_size}]"
            )
        for name, t in (("src_rows", src_rows), ("index", index)):
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(
                    f"gather_rotate: {name} {tuple(t.shape)} must hold one "
                    f"entry per output row ({n})"
                )
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise ValueError(
                    f"gather_rotate: {name} dtype {t.dtype} is not an integer"
                )
        if table.dim() != 2 or table.shape[1] != rotary_dim:
            raise ValueError(
                f"gather_rotate: table {tuple(table.shape)} must be "
                f"[entries, rotary_dim {rotary_dim}]"
            )
        if table.dtype != torch.float32 or not table.is_contiguous():
            raise ValueError(
                f"gather_rotate: table must be contiguous float32, got "
                f"{table.dtype}{'' if table.is_contiguous() else ', strided'}"
            )
        src_rows = src_rows.to(torch.int64).contiguous()
        index = index.to(torch.int64).contiguous()
        for name, t in (
            ("pool", pool),
            ("src_rows", src_rows),
            ("index", index),
            ("table", table),
        ):
            if _overlap(out, t):
                raise ValueError(f"gather_rotate: out overlaps {name} in memory")
        return src_rows, index

    def _run(
        self,
        pool: torch.Tensor,
        src_rows: torch.Tensor,
        index: torch.Tensor,
        table: torch.Tensor,
        rotation: RopeRotation,
        out: torch.Tensor,
    ) -> int:
        """The entry's status on checked arguments (0, row + 1, or -1)."""
        n, heads, head_size = out.shape
        return self._entries[pool.dtype](
            pool.data_ptr(),
            pool.shape[0],
            src_rows.data_ptr(),
            index.data_ptr(),
            n,
            table.data_ptr(),
            table.shape[0],
            heads,
            head_size,
            rotation.rotary_dim,
            int(rotation.is_neox_style),
            int(rotation.rounding is Rounding.ADDCMUL),
            torch.get_num_threads(),
            out.data_ptr(),
        )

    def __call__(
        self,
        pool: torch.Tensor,
        src_rows: torch.Tensor,
        index: torch.Tensor,
        table: torch.Tensor,
        rotation: RopeRotation,
        out: torch.Tensor,
    ) -> None:
        """out[r] = pool[src_rows[r]] rotated by table[index[r]] (cos | sin of
        rotary_dim, fp32), in the pool's dtype. `pool` [rows, heads, head_size]
        and `out` [n, heads, head_size] contiguous on the CPU, not overlapping."""
        src_rows, index = self._checked(pool, src_rows, index, table, rotation, out)
        if out.shape[0] == 0:
            return
        # NOTE: settles the rotation's rounding (the op's self-check, once)
        # before the kernel reads it.
        rotation.rotates_in_place(pool.device)
        bad = self._run(pool, src_rows, index, table, rotation, out)
        if bad == _NONFINITE:
            load_key_passes(pool, src_rows, rotation, index, table, out)
        elif bad:
            raise IndexError(
                f"gather_rotate: row {bad - 1} reads pool row "
                f"{int(src_rows[bad - 1])} of {pool.shape[0]} or table entry "
                f"{int(index[bad - 1])} of {table.shape[0]}"
            )

    def serves(self, rotation: RopeRotation, pool: torch.Tensor) -> bool:
        """Whether loads of `pool` rotated by `rotation` go through the kernel:
        on the CPU, where vLLM's RoPE op is used, and where the kernel's bytes
        equal the passes' on a sample (checked once per rotation and dtype)."""
        return self.why_not(rotation, pool) is None

    def why_not(self, rotation: RopeRotation, pool: torch.Tensor) -> str | None:
        """None if `serves`, else the reason (for the start-up log)."""
        if pool.device.type != "cpu" or not rotation.rotates_in_place(pool.device):
            return "not vLLM's CPU RoPE op path"
        if pool.dtype not in self._entries:
            return f"no kernel for {pool.dtype}"
        shape = _Shape(
            rotation.frequency_key,
            rotation.is_neox_style,
            rotation.rotary_dim,
            rotation.head_size,
            rotation.rounding,
            pool.dtype,
        )
        if shape not in self._verdicts:
            try:
                self._verdicts[shape] = self._check(rotation, pool.shape[1], pool.dtype)
            except Exception as e:  # a check that cannot run refuses, never stops
                self._verdicts[shape] = (
                    f"its start-up check failed: {type(e).__name__}: {e}"
                )
        return self._verdicts[shape]

    def _check(
        self, rotation: RopeRotation, heads: int, dtype: torch.dtype
    ) -> str | None:
        """The kernel against the passes (`load_key_passes`) on a sample: finite
        rows (normal, subnormal and large values) byte for byte with the
        kernel's own result; rows with NaN, Inf or a rotation that overflows
        reported by the kernel (and loaded by the passes)."""
        finite, nonfinite = start_up_sample(rotation, heads, dtype)
        for label, (pool, src, index, table), status in (
            ("finite", finite, 0),
            ("NaN/Inf", nonfinite, _NONFINITE),
        ):
            expected = load_key_passes(
                pool,
                src,
                rotation,
                index,
                table,
                torch.empty(src.shape[0], heads, rotation.head_size, dtype=dtype),
            )
            got = torch.empty_like(expected)
            src, index = self._checked(pool, src, index, table, rotation, got)
            bad = self._run(pool, src, index, table, rotation, got)
            if bad != status:
                return (
                    f"it answered {bad} on the start-up sample's {label} rows, not "
                    f"{status}"
                )
            if status == _NONFINITE:
                self(pool, src, index, table, rotation, got)
            differ = int((got.view(torch.uint8) != expected.view(torch.uint8)).sum())
            if differ:
                return (
                    f"its bytes differ from the passes' in {differ} of "
                    f"{expected.nbytes} sampled bytes ({label} rows) on this CPU"
                )
        return None


def start_up_sample(rotation: RopeRotation, heads: int, dtype: torch.dtype):
    """Two samples (pool, src_rows, index, table) for `_check`: finite rows
    (normal, subnormal and large values of `dtype`, deltas of both signs up to
    ~1e5 positions, and 0: a sine of exactly 0), and rows with NaN (several
    patterns), Inf, and values whose rotation overflows fp32."""
    head_size = rotation.head_size
    generator = torch.Generator().manual_seed(0)
    info = torch.finfo(dtype)
    # Large: a rotation stays finite in fp32 (the 16-bit cast may overflow).
    large = min(float(info.max) / 2, 1e30)
    scales = [4.0] * 6 + [float(info.tiny) * 4, float(info.tiny) / 64, large, 1.0]
    # Clamped: no Inf in the pool's finite rows (2 * bound still fits fp32).
    bound = min(float(info.max), 1e38) / 2
    rows = [
        (
            s
            * torch.randn(8, heads, head_size, generator=generator, dtype=torch.float64)
        ).clamp(-bound, bound)
        for s in scales
    ]
    pool = torch.cat(rows).to(dtype)
    src = torch.randperm(pool.shape[0], generator=generator)
    deltas = torch.tensor([0, 1, -1, 7, -513, 4099, 31000, -99991], dtype=torch.int64)
    index = torch.arange(src.shape[0], dtype=torch.int64) % deltas.shape[0]
    table = rotation.stretch_cos_sin(deltas, torch.device("cpu")).op_table()
    finite = (pool, src, index, table)

    bad = pool[:24].clone()
    raw = bad.view(torch.int16 if dtype != torch.float32 else torch.int32)
    nan_patterns = {
        torch.bfloat16: [0x7FC0, -0x0040, 0x7F81, 0x7FFF],
        torch.float16: [0x7E00, -0x0200, 0x7C01, 0x7FFF],
        torch.float32: [0x7FC00000, -0x00400000, 0x7F800001, 0x7FFFFFFF],
    }[dtype]
    for r, pattern in enumerate(nan_patterns):  # in the rotated part and past it
        raw[r, 0, 0] = pattern
        raw[4 + r, -1, -1] = pattern
    bad[8, 0, 1] = float("inf")
    bad[9, 0, 0] = float("-inf")
    bad[10, -1, -1] = float("inf")
    bad[11] = float(info.max)  # overflows fp32 (16-bit types: Inf rows then)
    nonfinite_src = torch.arange(bad.shape[0], dtype=torch.int64)
    nonfinite_index = torch.zeros(
        bad.shape[0], dtype=torch.int64
    )  # delta 0: Inf * sin 0
    nonfinite_index[1::2] = 4
    return finite, (bad, nonfinite_src, nonfinite_index, table)
