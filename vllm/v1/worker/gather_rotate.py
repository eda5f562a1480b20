# SPDX-License-Identifier: Apache-2.0
"""K's CPU load in one pass: gather, fp32 rotation, cast back (issue 52).

On the CPU the remapper loads K in four passes over the rows: `index_select`
from the pool, a cast to fp32, vLLM's RoPE op in place, a cast back
(position_remapper.py). `gather_rotate.c` does the same per row in one pass.
It is compiled at first use with the machine's C compiler into vLLM's cache
directory (keyed by the source, the flags, the compiler and the CPU's
flags), and a remapper uses it only for a rotation and dtype where a
self-check finds its bytes equal to those passes': the passes' numerics are
the ones the exactness suites hold, so the kernel changes time, not bits.
Anything that stops it (no compiler, a failed build, a differing byte) keeps
the passes and says why in the start-up log.

NOTE: measured with `benchmarks/bench_cpu_load.py` (docs/benchmarks.md,
issue 52 fifth pass). V needs no rotation: its gather stays `index_select`,
and the write stays the attention backend's own op, whose cache layout
depends on the ISA.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm.v1.worker.position_remapper import RopeRotation, Rounding

SOURCE = Path(__file__).with_suffix(".c")
# -ffp-contract=off: a product the source rounds on its own must stay rounded
# (the rounding is chosen per rotation, `Rounding`); -march=native: the key
# below includes the CPU's flags, so a cache shared by two machines never
# hands one the other's build.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
_ENTRIES = {
    torch.bfloat16: "gather_rotate_bf16",
    torch.float16: "gather_rotate_f16",
    torch.float32: "gather_rotate_f32",
}
_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class BuildError(RuntimeError):
    """The kernel could not be built or loaded here (the message says why)."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compile(compiler: str, target: Path, openmp: bool) -> subprocess.CompletedProcess:
    command = [compiler, *FLAGS, *(("-fopenmp",) if openmp else ()), "-o", str(target),
               str(SOURCE)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def build(cache_dir: Path, compiler: str | None = None) -> Path:
    """The kernel's shared library in `cache_dir`, compiled if not there yet."""
    compiler = compiler or os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise BuildError(f"no C compiler ({compiler!r} not found)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.blake2b(digest_size=12)
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(),
                 _cpu_flags().encode(), platform.machine().encode()):
        digest.update(part)
        digest.update(b"\0")
    target = cache_dir / f"gather_rotate-{digest.hexdigest()}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: compiled under a name of its own, then renamed: workers of one
    # engine (tensor parallel) may build at the same time.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    done = _compile(compiler, partial, openmp=True)
    if done.returncode != 0:  # no OpenMP runtime to link: one thread
        done = _compile(compiler, partial, openmp=False)
    if done.returncode != 0:
        raise BuildError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
    os.replace(partial, target)
    return target


@dataclass(frozen=True)
class _Shape:
    """What a self-check's verdict holds for."""

    frequencies: bytes
    neox: bool
    rotary_dim: int
    head_size: int
    rounding: Rounding
    dtype: torch.dtype


class GatherRotate:
    """The loaded kernel, and the rotations it was checked to serve."""

    def __init__(self, library: Path):
        self.library = library
        try:
            lib = ctypes.CDLL(str(library))
        except OSError as e:
            raise BuildError(f"cannot load {library.name}: {e}") from None
        self._entries = {}
        for dtype, name in _ENTRIES.items():
            entry = getattr(lib, name)
            entry.restype = _I
            entry.argtypes = [_P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _INT, _INT, _INT, _P]
            self._entries[dtype] = entry
        self._verdicts: dict[_Shape, str | None] = {}

    @classmethod
    def load(cls, cache_dir: Path | None = None) -> "GatherRotate":
        """Build (once per machine) and load; BuildError says why not."""
        if cache_dir is None:
            import vllm.envs as envs

            cache_dir = Path(envs.VLLM_CACHE_ROOT) / "chunk_cache"
        return cls(build(cache_dir))

    def __call__(self, pool: torch.Tensor, src_rows: torch.Tensor, index: torch.Tensor,
                 table: torch.Tensor, rotation: RopeRotation, out: torch.Tensor) -> None:
        """out[r] = pool[src_rows[r]] rotated by table[index[r]] (cos | sin of
        rotary_dim, fp32), in the pool's dtype. `pool` [rows, heads, head_size]
        and `out` [n, heads, head_size] contiguous on the CPU."""
        n, heads, head_size = out.shape
        if not (pool.is_contiguous() and out.is_contiguous() and pool.dtype == out.dtype
                and tuple(pool.shape[1:]) == (heads, head_size) and src_rows.shape[0] == n):
            raise ValueError("gather_rotate: contiguous pool and out of one row shape and "
                             "dtype, one source row per output row")
        # NOTE: settles the rotation's rounding (the op's self-check, once)
        # before the kernel reads it.
        rotation.rotates_in_place(pool.device)
        src_rows = src_rows.to(torch.int64).contiguous()
        index = index.to(torch.int64).contiguous()
        table = table.to(torch.float32).contiguous()
        bad = self._entries[pool.dtype](
            pool.data_ptr(), pool.shape[0], src_rows.data_ptr(), index.data_ptr(), n,
            table.data_ptr(), table.shape[0], heads, head_size, rotation.rotary_dim,
            int(rotation.is_neox_style), int(rotation.rounding is Rounding.ADDCMUL),
            torch.get_num_threads(), out.data_ptr())
        if bad:
            raise IndexError(f"gather_rotate: row {bad - 1} reads pool row "
                             f"{int(src_rows[bad - 1])} of {pool.shape[0]} or table entry "
                             f"{int(index[bad - 1])} of {table.shape[0]}")

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
        shape = _Shape(rotation.frequency_key, rotation.is_neox_style, rotation.rotary_dim,
                       rotation.head_size, rotation.rounding, pool.dtype)
        if shape not in self._verdicts:
            self._verdicts[shape] = self._check(rotation, pool.shape[1], pool.dtype)
        return self._verdicts[shape]

    def _check(self, rotation: RopeRotation, heads: int, dtype: torch.dtype) -> str | None:
        generator = torch.Generator().manual_seed(0)
        pool = (4 * torch.randn(96, heads, rotation.head_size, generator=generator)).to(dtype)
        src = torch.randperm(96, generator=generator)[:80]
        # Deltas of both signs, up to ~1e5 positions (large angles).
        deltas = torch.tensor([0, 1, -1, 7, -513, 4099, 31000, -99991], dtype=torch.int64)
        index = torch.arange(80, dtype=torch.int64) % deltas.shape[0]
        table = rotation.stretch_cos_sin(deltas, pool.device).op_table()
        passes = pool.index_select(0, src).float()
        rotation.rotate_in_place_indexed(passes, index, table)
        expected = passes.to(dtype)
        got = torch.empty_like(expected)
        self(pool, src, index, table, rotation, got)
        differ = int((got.view(torch.uint8) != expected.view(torch.uint8)).sum())
        if differ:
            return (f"its bytes differ from the passes' in {differ} of "
                    f"{expected.nbytes} sampled bytes on this CPU")
        return None
