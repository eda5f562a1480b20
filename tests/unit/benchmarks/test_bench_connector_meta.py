"""benchmarks/bench_connector_meta.py runs (a small size), and what it measures is
the real metadata: every row of the step is loaded, every document's row stored."""

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_connector_meta.py"
_spec = importlib.util.spec_from_file_location("bench_connector_meta", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_connector_meta"] = bench
_spec.loader.exec_module(bench)


def test_loads_and_captures_of_a_small_step():
    loads = bench.measure(num_docs=3, doc_tokens=40, repeat=2)
    # System (8) and three documents: every row before the question.
    assert loads["rows"] == 8 + 3 * 40 and loads["bytes"] > 0
    captures = bench.measure_captures(num_docs=3, doc_tokens=40, repeat=2)
    assert captures["rows"] == 8 + 3 * 40 and captures["bytes"] > 0
