"""benchmarks/bench_store.py runs on the real store (small values): the bytes read
back are checked inside run(), and every rate it reports is a measured one."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_store.py"
_spec = importlib.util.spec_from_file_location("bench_store", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_store"] = bench
_spec.loader.exec_module(bench)


@pytest.mark.parametrize(
    "local_client", [False, True], ids=["in-process", "nodes-client"]
)
def test_small_run_reports_every_rate(local_client):
    rows = bench.run([0.25, 0.5], batch=2, repeats=2, local_client=local_client)
    assert [r["size_mb"] for r in rows] == [0.25, 0.5]
    for r in rows:
        for k in (
            "store_GBps",
            "store_one_GBps",
            "memcpy_GBps",
            "tcp_GBps",
            "xxh3_GBps",
        ):
            assert r[k] > 0, (k, r)
        assert abs(r["ratio"] - r["store_GBps"] / r["memcpy_GBps"]) < 1e-9
