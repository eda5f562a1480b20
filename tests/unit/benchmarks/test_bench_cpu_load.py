"""benchmarks/bench_cpu_load.py and bench_block_hashing.py run (small sizes). Their
checks run in the scripts before any timing: every piece size writes the same cache
bytes, the write by index into the cache's own layout writes the bytes vLLM's
`cpu_attn_reshape_and_cache` writes (where the machine's ISA packs the "vec" layouts;
elsewhere that row is not printed), and the chunked prompt's block hashes are the same
with the starts remembered or looked up per block. No time is asserted."""

import importlib.util
import sys
from pathlib import Path

_DIR = Path(__file__).resolve().parents[3] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_cpu_load_runs_every_piece_size_and_each_pass(monkeypatch, capsys):
    bench = _load("bench_cpu_load")
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_cpu_load.py",
            "--docs",
            "3",
            "--doc-tokens",
            "40",
            "--pieces",
            "64",
            "16",
            "--reps",
            "2",
            "--head",
            "64",
        ],
    )
    bench.main()
    out = capsys.readouterr().out
    assert "3 documents x 40 tokens = 120 rows" in out and "2x64" in out
    assert "pieces of     64 rows" in out and "pieces of     16 rows" in out
    for name in ("gather K", "gather V", "rotate K", "write K+V"):
        assert name in out


def test_cpu_load_cold_write_runs_its_three_caches(monkeypatch, capsys):
    # The write alone into a cache of just the request's blocks, and into a larger one
    # at the same blocks and at the next blocks every time (issue 52, third pass).
    bench = _load("bench_cpu_load")
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_cpu_load.py",
            "--docs",
            "3",
            "--doc-tokens",
            "40",
            "--pieces",
            "64",
            "--reps",
            "2",
            "--cold-write",
            "0.001",
        ],
    )
    bench.main()
    out = capsys.readouterr().out
    assert "the write alone, 120 rows x 4 layers" in out
    assert (
        "(8 blocks a layer)" in out
    )  # 0.001 GiB / (2 x 128 x 64 bf16 values) / 4 layers


def test_block_hashing_runs_each_row(monkeypatch, capsys):
    bench = _load("bench_block_hashing")
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_block_hashing.py",
            "--tokens",
            "700",
            "1500",
            "--doc-tokens",
            "100",
            "--block",
            "16",
            "--reps",
            "2",
        ],
    )
    bench.main()
    rows = [
        line.split()
        for line in capsys.readouterr().out.splitlines()
        if line.split() and line.split()[0].isdigit()
    ]
    assert [r[0] for r in rows] == ["700", "1500"]
