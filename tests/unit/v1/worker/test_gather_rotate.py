# SPDX-License-Identifier: Apache-2.0
"""The one-pass CPU load of K (gather_rotate.c) against the passes it replaces.

Oracles: the passes (`load_key_passes`: torch's `index_select` and casts with vLLM's own CPU
RoPE op, `torch.ops._C.rotary_embedding`), the generic `RopeRotation.rotate` (torch
elementwise ops with the rounding the op's self-check chose), and for both roundings on every
ISA body this CPU has, exact rational arithmetic (`fractions.Fraction`) with each rounding
modelled step by step: bytes equal, not within a tolerance. None shares code with the C
kernel. The kernel is the library shipped in the installed package (built with the wheel,
tools/forktool/cpu_kernel.py); libraries that must fail to load are tmp copies or tiny
libraries built here.
"""

import hashlib
import json
import logging
import math
import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from vllm.model_executor.layers.rotary_embedding import get_rope

from tests.unit.v1.worker.test_position_remapper import CASES, NUM_HEADS, make_rope
from vllm.v1.worker import gather_rotate
from vllm.v1.worker.gather_rotate import GatherRotate, LoadError, start_up_sample
from vllm.v1.worker.position_remapper import (
    PositionRemapper,
    RemapRows,
    RemapScratch,
    RopeRotation,
    Rounding,
    load_key_passes,
)

CPU = torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def kernel() -> GatherRotate:
    # NOTE: a library that fails to load here fails the tests (the wheel ships it); the
    # engine instead keeps the passes and logs why (worker.py).
    return GatherRotate.load()


def _sample(
    rotation: RopeRotation, dtype, rows=300, pool_rows=512, heads=NUM_HEADS, seed=0
):
    gen = torch.Generator().manual_seed(seed)
    pool = (4 * torch.randn(pool_rows, heads, rotation.head_size, generator=gen)).to(
        dtype
    )
    src = torch.randint(0, pool_rows, (rows,), generator=gen)
    deltas = torch.tensor([0, 5, -129, 3000, -40000, 99991])
    index = torch.randint(0, deltas.shape[0], (rows,), generator=gen)
    return pool, src, deltas, index


def _by_op(rotation, pool, src, index, table):
    """The remapper's passes (the one helper that holds them)."""
    out = torch.empty(src.shape[0], *pool.shape[1:], dtype=pool.dtype)
    return load_key_passes(pool, src, rotation, index, table, out)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "name, params, neox",
    CASES,
    ids=[f"{c[0]}-{'neox' if c[2] else 'gptj'}" for c in CASES],
)
def test_one_pass_equals_the_passes_byte_for_byte(
    vllm_config_context, kernel, name, params, neox, dtype
):
    rotation = RopeRotation(make_rope(params, neox))
    pool, src, deltas, index = _sample(rotation, dtype)
    table = rotation.stretch_cos_sin(deltas, CPU).op_table()
    got = torch.empty(src.shape[0], NUM_HEADS, rotation.head_size, dtype=dtype)
    kernel(pool, src, index, table, rotation, got)
    # The generic rotation (torch ops) with the rounding the op's check chose
    # (the kernel's call settled it).
    generic = rotation.rotate(pool[src], deltas[index])
    assert torch.equal(got.view(torch.uint8), generic.view(torch.uint8))
    if rotation.rotates_in_place(CPU):
        assert torch.equal(
            got.view(torch.uint8),
            _by_op(rotation, pool, src, index, table).view(torch.uint8),
        )
        assert kernel.serves(rotation, pool), kernel.why_not(rotation, pool)


@pytest.mark.parametrize("head_size, rotary_dim", [(80, 80), (128, 128), (96, 32)])
def test_other_head_sizes(vllm_config_context, kernel, head_size, rotary_dim):
    """Half widths the kernel does not specialise (40, 16 of 96) and one it does
    (64): the same bytes as the generic rotation."""
    rope = get_rope(
        head_size,
        4096,
        True,
        {"rope_type": "default", "partial_rotary_factor": rotary_dim / head_size},
        torch.float32,
    )
    rotation = RopeRotation(rope)
    assert rotation.rotary_dim == rotary_dim
    rotation.rotates_in_place(CPU)
    pool, src, deltas, index = _sample(rotation, torch.bfloat16, heads=3)
    table = rotation.stretch_cos_sin(deltas, CPU).op_table()
    got = torch.empty(src.shape[0], 3, head_size, dtype=torch.bfloat16)
    kernel(pool, src, index, table, rotation, got)
    assert torch.equal(
        got.view(torch.int16),
        rotation.rotate(pool[src], deltas[index]).view(torch.int16),
    )


def test_threads_split_rows_without_changing_a_byte(vllm_config_context, kernel):
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    rotation.rotates_in_place(CPU)
    pool, src, deltas, index = _sample(
        rotation, torch.bfloat16, rows=20_000, pool_rows=30_000
    )
    table = rotation.stretch_cos_sin(deltas, CPU).op_table()
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty(
                src.shape[0], NUM_HEADS, rotation.head_size, dtype=torch.bfloat16
            )
            kernel(pool, src, index, table, rotation, out)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert torch.equal(
        outs[0].view(torch.int16),
        rotation.rotate(pool[src], deltas[index]).view(torch.int16),
    )


def test_an_index_out_of_range_is_an_error_not_a_read(vllm_config_context, kernel):
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    pool, src, deltas, index = _sample(rotation, torch.bfloat16, rows=10, pool_rows=16)
    table = rotation.stretch_cos_sin(deltas, CPU).op_table()
    out = torch.full((10, NUM_HEADS, rotation.head_size), 7.0, dtype=torch.bfloat16)
    for bad_src, bad_index, text in (
        (16, 0, "pool row 16 of 16"),
        (-1, 0, "pool row -1"),
        (0, 6, "table entry 6 of 6"),
    ):
        s, i = src.clone(), index.clone()
        s[4], i[4] = bad_src, bad_index
        with pytest.raises(IndexError, match=f"row 4 reads .*{text}"):
            kernel(pool, s, i, table, rotation, out)
    # Checked before anything is written.
    assert bool((out == 7.0).all())
    with pytest.raises(ValueError, match="contiguous"):
        kernel(pool, src, index, table, rotation, out[:, :1])


def test_remapper_with_the_kernel_writes_what_the_passes_write(
    vllm_config_context, kernel
):
    """Through `PositionRemapper.remap_layer` with the step's stretch table, in
    pieces through one scratch, as the worker loads: the written K and V equal
    the remapper's without the kernel (gather, casts, vLLM's op), byte for byte."""
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    pool_k = (4 * torch.randn(400, NUM_HEADS, rotation.head_size)).to(torch.bfloat16)
    pool_v = torch.randn(400, NUM_HEADS, rotation.head_size).to(torch.bfloat16)
    if not kernel.serves(rotation, pool_k):
        pytest.fail(
            f"the kernel is refused for the default rope: {kernel.why_not(rotation, pool_k)}"
        )
    stretch_deltas = torch.tensor([17, -5, 2048])
    stretch_index = torch.arange(240) // 80
    rows = RemapRows(
        src_rows=torch.randperm(400)[:240],
        dst_slots=torch.randperm(300)[:240],
        deltas=stretch_deltas[stretch_index],
        stretch_index=stretch_index,
        stretch_deltas=stretch_deltas,
    )
    stretches = rotation.stretch_cos_sin(stretch_deltas, CPU)
    caches = {}
    for label, one_pass in (("kernel", kernel), ("passes", None)):
        cache_k = torch.zeros(300, NUM_HEADS, rotation.head_size, dtype=torch.bfloat16)
        cache_v = torch.zeros_like(cache_k)

        def write_rows(name, key, value, slots, cache_k=cache_k, cache_v=cache_v):
            cache_k[slots] = key
            cache_v[slots] = value

        remapper = PositionRemapper(rotation, write_rows, RemapScratch(64), one_pass)
        for piece in rows.pieces(64):
            remapper.remap_layer("l", pool_k, pool_v, piece, stretches)
        caches[label] = (cache_k, cache_v)
    for got, expected in zip(caches["kernel"], caches["passes"]):
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


# ---------------------------------------------------------------- loading (issue 59)


def _library_dir(
    tmp_path: Path, *, drop=(), truncate=(), replace=None, digests_of_copies=False
) -> Path:
    """A tmp copy of the installed libraries and their digests, some dropped, cut short or
    replaced; `digests_of_copies`: the digests file describes the copies (so a replaced
    library reaches the loader)."""
    digests = json.loads(gather_rotate.DIGESTS.read_text())
    for lib in (gather_rotate.LIBRARY, gather_rotate.SERIAL_LIBRARY):
        if lib.name in drop:
            continue
        data = lib.read_bytes()
        if lib.name in truncate:
            data = data[: len(data) // 3]
        if replace is not None:
            data = replace.read_bytes()
        (tmp_path / lib.name).write_bytes(data)
        if digests_of_copies:
            digests[lib.name] = hashlib.sha256(data).hexdigest()
    (tmp_path / gather_rotate.DIGESTS.name).write_text(json.dumps(digests))
    return tmp_path


def _build_c(tmp_path: Path, name: str, source: str) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "these tests build a tiny library: no C compiler found"
    c = tmp_path / f"{name}.c"
    c.write_text(source)
    out = tmp_path / f"{name}.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(out), str(c)], check=True)
    return out


# Exports the ABI probe only: every other symbol is missing.
NO_ENTRIES = "int gather_rotate_abi(void) { return 2; }\n"
# The whole interface, with entries that write zeros: loads, checks wrong.
ZEROS = """
#include <stdint.h>
#include <string.h>
int gather_rotate_abi(void) { return 2; }
const char *gather_rotate_isa(void) { return "wrong on purpose"; }
int gather_rotate_use_isa(int which) { (void)which; return 0; }
#define ENTRY(NAME, SIZE) int64_t NAME(const void *pool, int64_t pool_rows, const int64_t *src, \
    const int64_t *index, int64_t n, const float *table, int64_t entries, int64_t heads, \
    int64_t head_size, int64_t rotary_dim, int neox, int fused, int threads, void *out) { \
    memset(out, 0, (size_t)(n * heads * head_size * SIZE)); return 0; }
ENTRY(gather_rotate_bf16, 2)
ENTRY(gather_rotate_f16, 2)
ENTRY(gather_rotate_f32, 4)
"""


def _bare_worker():
    """The worker's kernel-loading state alone (its `_one_pass_for`)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.worker import (
        ChunkCacheWorker,
    )

    worker = ChunkCacheWorker.__new__(ChunkCacheWorker)
    worker._gather_rotate = None
    worker._one_pass_why = {}
    return worker


def _no_compiler(monkeypatch):
    """Any attempt to run a program (a compiler) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"the kernel's load ran a program: {args[:1]}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_the_engine_side_load_never_touches_the_cache_root(
    vllm_config_context, tmp_path, monkeypatch
):
    """Issue 59: VLLM_CACHE_ROOT below a file stopped the engine (NotADirectoryError from the
    run-time build's mkdir). The shipped library loads without a compiler or a cache dir."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(blocker / "cache"))
    _no_compiler(monkeypatch)
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    pool = torch.zeros(16, NUM_HEADS, rotation.head_size, dtype=torch.bfloat16)
    worker = _bare_worker()
    kernel = worker._one_pass_for(rotation, pool)
    assert isinstance(worker._gather_rotate, GatherRotate), worker._gather_rotate
    if rotation.rotates_in_place(CPU):
        assert kernel is worker._gather_rotate, worker._one_pass_why
    assert not (blocker.parent / "cache").exists()


@pytest.mark.parametrize(
    "broken",
    ["missing", "truncated", "truncated-digest-matches", "no-entries", "other-abi"],
)
def test_a_broken_library_keeps_the_passes_and_says_why_once(
    vllm_config_context, tmp_path, monkeypatch, caplog, broken
):
    """Missing, truncated, a library without the entries (AttributeError) or of another
    interface: the worker keeps the passes, logs why once (two rotations here), never
    raises. Tmp copies: the installed library is not touched."""
    if broken == "missing":
        directory = _library_dir(
            tmp_path,
            drop=(gather_rotate.LIBRARY.name, gather_rotate.SERIAL_LIBRARY.name),
        )
        expected = "not found"
    elif broken == "truncated":
        directory = _library_dir(
            tmp_path,
            truncate=(gather_rotate.LIBRARY.name, gather_rotate.SERIAL_LIBRARY.name),
        )
        expected = "truncated or replaced"
    elif broken == "truncated-digest-matches":
        # NOTE: not loaded at all: dlopen of a library cut short can die of SIGBUS, so
        # only a header too short to map is tried (an OSError from the loader).
        (tmp_path / "cut").write_bytes(gather_rotate.LIBRARY.read_bytes()[:40])
        directory = tmp_path / "lib"
        directory.mkdir()
        _library_dir(directory, replace=tmp_path / "cut", digests_of_copies=True)
        expected = "OSError"
    elif broken == "no-entries":
        directory = _library_dir(
            tmp_path,
            replace=_build_c(tmp_path, "bare", NO_ENTRIES),
            digests_of_copies=True,
        )
        expected = "AttributeError"
    else:
        other = NO_ENTRIES.replace("return 2", "return 1")
        directory = _library_dir(
            tmp_path, replace=_build_c(tmp_path, "old", other), digests_of_copies=True
        )
        expected = "interface 1"
    monkeypatch.setattr(gather_rotate, "HERE", directory)
    _no_compiler(monkeypatch)
    worker = _bare_worker()
    rotations = [
        RopeRotation(make_rope({"rope_type": "default"}, neox)) for neox in (1, 0)
    ]
    pool = torch.zeros(16, NUM_HEADS, rotations[0].head_size, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        for rotation in rotations:
            assert worker._one_pass_for(rotation, pool) is None
            assert "K loaded in passes" in worker._one_pass_why[id(rotation)]
    assert expected in worker._gather_rotate
    warnings = [r for r in caplog.records if "could not be loaded" in r.getMessage()]
    assert len(warnings) == 1 and expected in warnings[0].getMessage()
    with pytest.raises(LoadError, match=expected):
        GatherRotate.load(directory)


def test_the_check_refuses_a_library_that_loads_but_computes_otherwise(
    vllm_config_context, tmp_path, monkeypatch
):
    library = _build_c(tmp_path, "zeros", ZEROS)
    monkeypatch.setattr(gather_rotate, "torch_openmp_runtime", lambda: None)
    wrong = GatherRotate.load(
        _library_dir(tmp_path, replace=library, digests_of_copies=True)
    )
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    if not rotation.rotates_in_place(CPU):
        pytest.fail("vLLM's CPU RoPE op path is needed for the one-pass check")
    pool = torch.zeros(16, NUM_HEADS, rotation.head_size, dtype=torch.bfloat16)
    why = wrong.why_not(rotation, pool)
    assert why is not None and "differ from the passes'" in why, why


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_the_check_refuses_the_kernel_with_the_other_rounding(
    vllm_config_context, kernel, neox
):
    """The kernel told the rounding the op does not use: the start-up check refuses it."""
    rotation = RopeRotation(make_rope({"rope_type": "default"}, neox))
    if not rotation.rotates_in_place(CPU):
        pytest.fail("vLLM's CPU RoPE op path is needed for the one-pass check")
    pool = torch.zeros(16, NUM_HEADS, rotation.head_size, dtype=torch.float32)
    assert kernel.why_not(rotation, pool) is None
    # Forced: the passes (vLLM's op) keep their rounding, the kernel is told the other.
    rotation.rounding = (
        Rounding.PRODUCTS if rotation.rounding is Rounding.ADDCMUL else Rounding.ADDCMUL
    )
    why = kernel.why_not(rotation, pool)
    assert why is not None and "differ from the passes'" in why, why


# ---------------------------------------------------------------- the wrapper's checks


def _valid(rotation, dtype=torch.bfloat16, n=6):
    pool, src, deltas, index = _sample(rotation, dtype, rows=n, pool_rows=16)
    table = rotation.stretch_cos_sin(deltas, CPU).op_table()
    out = torch.empty(n, NUM_HEADS, rotation.head_size, dtype=dtype)
    return dict(
        pool=pool, src_rows=src, index=index, table=table, rotation=rotation, out=out
    )


def _bad_rotary_dim(rotation, value):
    other = RopeRotation.__new__(RopeRotation)
    other.__dict__.update(rotation.__dict__)
    other.rotary_dim = value
    return other


WRAPPER_CASES = {
    "index-length": (
        lambda a: a.update(index=a["index"][:-1]),
        "index .* one entry per",
    ),
    "src-length": (
        lambda a: a.update(src_rows=a["src_rows"][:-2]),
        "src_rows .* one entry",
    ),
    "src-2d": (
        lambda a: a.update(src_rows=a["src_rows"][:, None]),
        "src_rows .* one entry",
    ),
    "src-float": (lambda a: a.update(src_rows=a["src_rows"].float()), "src_rows dtype"),
    "index-float": (lambda a: a.update(index=a["index"].double()), "index dtype"),
    "table-1d": (lambda a: a.update(table=a["table"].flatten()), "table .* must be"),
    "table-columns": (
        lambda a: a.update(table=a["table"][:, :-2].contiguous()),
        "table .* rotary_dim",
    ),
    "table-fp64": (
        lambda a: a.update(table=a["table"].double()),
        "table must be .*float32",
    ),
    "table-strided": (
        lambda a: a.update(table=torch.cat([a["table"]] * 2, 1)[:, ::2]),
        "table must be contiguous",
    ),
    "rotary-dim-over-head": (
        lambda a: a.update(
            rotation=_bad_rotary_dim(a["rotation"], a["rotation"].head_size + 2)
        ),
        "rotary_dim .* head_size",
    ),
    "rotary-dim-odd": (
        lambda a: a.update(rotation=_bad_rotary_dim(a["rotation"], 63)),
        "rotary_dim 63 must be even",
    ),
    "pool-on-meta": (lambda a: a.update(pool=a["pool"].to("meta")), "pool is on meta"),
    "out-on-meta": (lambda a: a.update(out=a["out"].to("meta")), "out is on meta"),
    "table-on-meta": (
        lambda a: a.update(table=a["table"].to("meta")),
        "table is on meta",
    ),
    "out-dtype": (lambda a: a.update(out=a["out"].half()), "out dtype .* differs"),
    "pool-dtype": (
        lambda a: a.update(
            pool=a["pool"].to(torch.int16), out=a["out"].to(torch.int16)
        ),
        "not supported",
    ),
    "out-overlaps-pool": (lambda a: a.update(out=a["pool"][3:9]), "out overlaps pool"),
    "head-size": (
        lambda a: a.update(
            pool=a["pool"][..., :32].contiguous(), out=a["out"][..., :32].contiguous()
        ),
        "head_size",
    ),
    "row-shape": (
        lambda a: a.update(out=torch.empty(6, 1, 64, dtype=torch.bfloat16)),
        "row shape",
    ),
}


@pytest.mark.parametrize("case", list(WRAPPER_CASES))
def test_the_wrapper_checks_before_a_pointer_reaches_c(
    vllm_config_context, kernel, case
):
    """Issue 59: index/src lengths, the table's shape, dtype and layout, rotary_dim against
    head_size, every tensor on the CPU, integer indices, out not overlapping the pool, the
    dtypes: a ValueError naming what is wrong, nothing written."""
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    args = _valid(rotation)
    change, message = WRAPPER_CASES[case]
    change(args)
    out = args["out"]
    before = out.clone() if out.device.type == "cpu" else None
    with pytest.raises(ValueError, match=message):
        kernel(**args)
    if before is not None and case != "out-overlaps-pool":
        assert torch.equal(_bytes(out), _bytes(before))


def test_out_overlapping_any_input_is_refused(vllm_config_context, kernel):
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    args = _valid(rotation, torch.float32)
    flat = torch.zeros(args["out"].numel() + 64, dtype=torch.float32)
    args["out"] = flat[64:].view(args["out"].shape)
    args["table"] = flat[: 2 * 64].view(2, 64)
    args["index"] = args["index"].clamp(max=1)
    with pytest.raises(ValueError, match="out overlaps table"):
        kernel(**args)


def test_int32_indices_are_converted(vllm_config_context, kernel):
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    args = _valid(rotation)
    expected = _by_op(
        rotation, args["pool"], args["src_rows"], args["index"], args["table"]
    )
    args["src_rows"], args["index"] = args["src_rows"].int(), args["index"].int()
    kernel(**args)
    assert torch.equal(_bytes(args["out"]), _bytes(expected))


# ---------------------------------------------------------------- both roundings, exactly

# (significand bits, lowest normal exponent, highest exponent) of each format.
FORMATS = {
    torch.float32: (24, -126, 127),
    torch.bfloat16: (8, -126, 127),
    torch.float16: (11, -14, 15),
}


def _round(x: Fraction, dtype) -> Fraction | float:
    """X rounded to nearest even in `dtype` (subnormals, overflow to Inf)."""
    if x == 0:
        return Fraction(0)
    precision, emin, emax = FORMATS[dtype]
    sign, a = (-1 if x < 0 else 1), abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    quantum = Fraction(2) ** (max(e, emin) - precision + 1)
    steps, rest = divmod(a, quantum)
    if rest > quantum / 2 or (rest == quantum / 2 and steps % 2 == 1):
        steps += 1
    value = steps * quantum
    if value >= Fraction(2) ** (emax + 1):
        return sign * math.inf
    return sign * value


def _exact_rotation(x: torch.Tensor, cos_sin: torch.Tensor, rotation, rounding, dtype):
    """One head [head_size] of `dtype` rotated by one table row, in exact arithmetic with
    the fp32 roundings of `rounding` modelled step by step, then rounded to `dtype`."""
    half = rotation.rotary_dim // 2
    values = [Fraction(float(v)) for v in x.double()]
    cs = [Fraction(float(v)) for v in cos_sin.double()]
    out = list(values)
    r32 = lambda v: _round(v, torch.float32)  # noqa: E731
    for i in range(half):
        i1, i2 = (i, half + i) if rotation.is_neox_style else (2 * i, 2 * i + 1)
        a, b, c, s = values[i1], values[i2], cs[i], cs[half + i]
        if rounding is Rounding.PRODUCTS:
            c1, c2 = r32(r32(a * c) - r32(b * s)), r32(r32(b * c) + r32(a * s))
        else:  # one rounding of the fused multiply-add
            c1, c2 = r32(r32(a * c) - b * s), r32(r32(b * c) + a * s)
        assert c1 != 0 and c2 != 0, "a signed zero: not modelled, pick another sample"
        # A nonzero fp32 value that rounds to zero in `dtype` keeps its sign.
        out[i1], out[i2] = (_round(c, dtype) or math.copysign(0.0, c) for c in (c1, c2))
    return torch.tensor([float(v) for v in out], dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rounding", list(Rounding), ids=lambda r: r.name)
def test_both_roundings_on_every_body_against_exact_arithmetic(
    vllm_config_context, kernel, rounding, neox, dtype
):
    """Issue 59: the fused half ran only where vLLM's op fuses (AVX-512, neox). Here each
    rounding is forced (the op's self-check bypassed) on every ISA body this CPU has, with
    normal, subnormal and overflowing values, against exact rationals."""
    rotation = RopeRotation(make_rope({"rope_type": "default"}, neox))
    rotation._cpu_kernel, rotation.rounding = True, rounding  # forced, no op check
    gen = torch.Generator().manual_seed(7)
    scale = {
        torch.float16: [4.0, 1e-6, 2e4],
        torch.bfloat16: [4.0, 1e-39, 1e30],
        torch.float32: [4.0, 1e-41, 1e30],
    }[dtype]
    # Magnitudes in [0.25, 1.25) * scale, either sign: no value rounds to zero.
    rows = torch.cat(
        [
            s
            * (
                torch.rand(2, 1, rotation.head_size, generator=gen, dtype=torch.float64)
                + 0.25
            )
            * (torch.randint(0, 2, (2, 1, rotation.head_size), generator=gen) * 2 - 1)
            for s in scale
        ]
    )
    pool = rows.to(dtype)
    assert bool(pool.double().abs().gt(0).all()) and bool(pool.isfinite().all())
    deltas = torch.tensor([1, -513, 4099, -99991])
    table = rotation.stretch_cos_sin(deltas, CPU).op_table()
    src = torch.arange(pool.shape[0])
    index = src % deltas.shape[0]
    expected = torch.stack(
        [
            _exact_rotation(pool[r, 0], table[index[r]], rotation, rounding, dtype)
            for r in range(pool.shape[0])
        ]
    )[:, None]
    bodies = 0
    try:
        for isa in (0, 1, 2):
            if not kernel.use_isa(isa):
                continue
            bodies += 1
            got = torch.empty_like(pool)
            kernel(pool, src, index, table, rotation, got)
            assert torch.equal(_bytes(got), _bytes(expected)), (isa, rounding)
    finally:
        kernel.use_isa(-1)
    assert bodies >= 1


# ---------------------------------------------------------------- NaN, Inf, subnormals


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_nan_inf_and_subnormal_rows_give_the_passes_bytes(
    vllm_config_context, kernel, neox, dtype
):
    """Issue 59: NaN became 0x7fc0 where torch's cast writes another pattern, Inf times a
    zero sine gives NaN. The start-up sample's rows (NaN patterns, Inf, overflow, delta 0,
    subnormal and large values) through the kernel equal the passes byte for byte."""
    rotation = RopeRotation(make_rope({"rope_type": "default"}, neox))
    if not rotation.rotates_in_place(CPU):
        pytest.fail("vLLM's CPU RoPE op path is needed for the passes")
    for pool, src, index, table in start_up_sample(rotation, NUM_HEADS, dtype):
        got = torch.empty(src.shape[0], NUM_HEADS, rotation.head_size, dtype=dtype)
        kernel(pool, src, index, table, rotation, got)
        expected = _by_op(rotation, pool, src, index, table)
        assert torch.equal(_bytes(got), _bytes(expected))
    assert kernel.why_not(rotation, pool) is None


def test_the_start_up_sample_holds_nan_inf_and_subnormals(vllm_config_context):
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    for dtype in DTYPES:
        (finite, *_), (bad, *_) = start_up_sample(rotation, NUM_HEADS, dtype)
        tiny = torch.finfo(dtype).tiny
        assert bool(finite.isfinite().all())
        assert bool(((finite != 0) & (finite.abs() < tiny)).any()), dtype  # subnormal
        assert bool(bad.isnan().any()) and bool(bad.isinf().any()), dtype


# ---------------------------------------------------------------- threads


def test_the_kernel_runs_on_torchs_openmp_runtime(kernel):
    """Issue 59: the kernel's threads are torch's. Its library does not link libgomp; its
    GOMP_* symbols bind to the global one, which is torch's (no other libgomp is loaded
    for it: this process may hold others, e.g. sentencepiece's own copy)."""
    import ctypes
    import os

    runtime = gather_rotate.torch_openmp_runtime()
    if runtime is None:
        assert kernel.library.name == "_gather_rotate_serial.so"
        return
    assert kernel.openmp_runtime == runtime and "torch" in runtime, runtime
    assert kernel.library.name == "_gather_rotate.so"
    bound = ctypes.cast(ctypes.CDLL(None).GOMP_parallel, ctypes.c_void_p).value
    torchs = ctypes.CDLL(runtime, mode=os.RTLD_NOLOAD)
    assert bound == ctypes.cast(torchs.GOMP_parallel, ctypes.c_void_p).value
    readelf = shutil.which("readelf")
    if readelf:
        dynamic = subprocess.run(
            [readelf, "-d", str(kernel.library)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "libgomp" not in dynamic
