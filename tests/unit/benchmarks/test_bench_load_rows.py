"""benchmarks/bench_load_rows.py runs (small sizes), and its baseline (the pre-issue-52
expansion it times against) expands the same rows as LoadRows, checked in the script
itself before any timing; no time is asserted."""

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_load_rows.py"
_spec = importlib.util.spec_from_file_location("bench_load_rows", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_load_rows"] = bench
_spec.loader.exec_module(bench)


def test_runs_and_prints_a_ratio_per_size(monkeypatch, capsys):
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_load_rows.py",
            "--docs",
            "2",
            "5",
            "--doc-tokens",
            "37",
            "--block",
            "16",
            "--repeats",
            "2",
        ],
    )
    bench.main()
    lines = capsys.readouterr().out.splitlines()
    # The table's rows (vLLM's log may share stdout).
    rows = [
        line.split() for line in lines if line.split() and line.split()[0].isdigit()
    ]
    assert [(r[0], r[1]) for r in rows] == [("2", "74"), ("5", "185")]
    assert all(float(r[4]) > 0 for r in rows)
