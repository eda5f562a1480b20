"""The pure parts of benchmarks/bench_rag.py (no engine): the request stream, the
statistics and the table."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_rag.py"
# The benchmarks import their shared pieces (benchmarks/common.py) as scripts do.
sys.path.insert(0, str(_PATH.parent))
import common  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_rag", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_rag"] = bench  # dataclasses look their module up by name
_spec.loader.exec_module(bench)

WORK = bench.Workload(doc_words=20, requests=50, max_tokens=4, system="Sys.", seed=3)


def test_request_stream_is_deterministic_and_reuses_the_hot_set():
    point = bench.Point(k=4, reuse=0.9, concurrency=1)
    a = bench.make_prompts(WORK, point, "t")
    assert a == bench.make_prompts(WORK, point, "t")
    assert a != bench.make_prompts(WORK, point, "other")
    hot = set(common.make_corpus(8, 20, 3, "t-hot"))
    docs = [d for prompt, _ in a for d in prompt.split(" ## ")[1:-1]]
    assert len(docs) == 4 * 50
    share = sum(d in hot for d in docs) / len(docs)
    assert 0.8 < share <= 1.0
    for prompt, question in a:
        parts = prompt.split(" ## ")
        assert (
            parts[0] == "Sys." and parts[-1] == question and len(set(parts[1:-1])) == 4
        )
    cold = bench.make_prompts(WORK, bench.Point(4, 0.0, 1), "t")
    assert not any(d in hot for p, _ in cold for d in p.split(" ## ")[1:-1])


def test_percentile_matches_linear_interpolation():
    assert common.percentile([1, 2, 3, 4], 0.5) == 2.5
    assert common.percentile([10.0], 0.9) == 10.0
    assert common.percentile([0, 10], 0.9) == pytest.approx(9.0)


def test_table_has_ratios_from_the_same_run_and_the_floor():
    p = bench.Point(4, 0.5, 1)
    rows = [
        bench.Result("stock", p, [0.4, 0.6], 16, 2.0, None),
        bench.Result("prefix", p, [0.3, 0.3], 16, 2.0, 0.25),
        bench.Result("chunk", p, [0.1, 0.1], 16, 1.0, 0.5),
    ]
    table = bench.write_table(rows, {p: 0.05})
    assert "| 4 | 0.5 | 1 | stock | 500 | 580 | 1.00 | 8.0 | - | 5.00x |" in table
    assert "| prefix | 300 |" in table and "| 25% | 3.00x |" in table
    assert "chunk = 2.00x of floor" in table


def test_one_factor_sweeps_around_the_base_point():
    args = bench.parse_args(
        ["--docs", "2,4,8", "--reuse", "0,0.5", "--concurrency", "1,4"]
    )
    pts, base = bench.points(args)
    assert base == bench.Point(4, 0.5, 1)
    assert set(pts) == {
        bench.Point(2, 0.5, 1),
        bench.Point(4, 0.5, 1),
        bench.Point(8, 0.5, 1),
        bench.Point(4, 0.0, 1),
        bench.Point(4, 0.5, 4),
    }


def test_ratios_between_the_three_configurations():
    p = bench.Point(4, 0.5, 1)
    rows = [
        bench.Result("stock", p, [0.4, 0.6], 16, 2.0, None),
        bench.Result("prefix", p, [0.3, 0.3], 16, 2.0, 0.25),
        bench.Result("chunk", p, [0.1, 0.1], 16, 1.0, 0.5),
    ]
    ratios = bench.write_ratios(rows, {p: 0.05})
    # TTFT stock/chunk, prefix/chunk, stock/prefix; req/s chunk/stock, chunk/prefix;
    # floor.
    assert "| 4 | 0.5 | 1 | 5.00x | 3.00x | 1.67x | 2.00x | 2.00x | 2.00x |" in ratios
    # A point without all three configurations gets no ratio row.
    assert bench.write_ratios(rows[:2], {}).count("\n") == 2


def _targets():
    path = _PATH.with_name("bench_targets.py")
    spec = importlib.util.spec_from_file_location("bench_targets", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_targets"] = module
    spec.loader.exec_module(module)
    return module


def test_target_workloads_hit_the_same_documents_in_new_orders():
    targets = _targets()
    work = bench.Workload(doc_words=30, requests=5, max_tokens=4, system="Sys.", seed=1)
    hit = targets.hit_runs(work, 4, 5)
    sets = [frozenset(p.split(" ## ")[1:-1]) for p, _ in hit.timed]
    assert len(set(sets)) == 1 and len(sets[0]) == 4  # always the same 4 documents
    assert len({tuple(p.split(" ## ")[1:-1]) for p, _ in hit.timed}) > 1  # reordered
    assert set(hit.warmup[0].split(" ## ")[1:-1]) == sets[0]  # warmed before timing
    miss = targets.miss_runs(work, 8, 5)
    docs = [d for p, _ in miss.timed for d in p.split(" ## ")[1:-1]]
    assert len(docs) == len(set(docs)) == 40  # never a document seen before
    assert targets.load_runs(work, 8, 16).concurrency == 8


def test_verdicts_compare_each_target_with_its_threshold():
    targets = _targets()

    def result(config, name, ttft, wall=1.0):
        r = bench.Result(config, bench.Point(8, 0, 1), ttft=[ttft] * 3)
        r.wall = wall
        return r

    results = {}
    for name in ("hit-4", "hit-8", "miss-8", "load-8"):
        results[("stock", name)] = result("stock", name, 10.0, wall=30.0)
        results[("prefix", name)] = result("prefix", name, 5.0, wall=20.0)
        results[("chunk", name)] = result("chunk", name, 0.3, wall=5.0)
    found = {
        v.target: v
        for v in targets.verdicts(
            results, {"hit-4": 0.2, "hit-8": 0.1}, remap_share=0.6
        )
    }
    assert found["all-hit, 8 docs: TTFT >= 25x lower than stock"].met  # 33x
    assert not found["all-hit, 8 docs: TTFT >= 25x lower than prefix"].met  # 16.7x
    assert found["all-hit, 4 docs: TTFT <= 2x the floor"].met  # 1.5x
    assert not found["all-hit, 8 docs: TTFT <= 2x the floor"].met  # 3x
    assert found["all-miss first request, 8 docs: TTFT <= stock"].met
    assert found["load (concurrency 8, 80% reuse, 8 docs): req/s >= 5x stock"].met  # 6x
    assert found["remap >= 50% of plain-copy throughput"].met


def test_recompute_table_puts_every_configuration_against_sink():
    import bench_recompute

    Point, Result = bench.Point, bench.Result
    results = {}
    for i, config in enumerate(bench_recompute.CONFIGS):
        for k in bench_recompute.DOCS:
            r = Result(config, Point(k, 0.0, 1))
            r.ttft = [0.1 * (i + 1) * k / 4] * 3
            results[(config, k)] = r
    text = bench_recompute.table(results)
    assert "| `sink` | 200.0 | 1.00x | 400.0 | 1.00x |" in text
    assert "| `sink+K12` | 400.0 | 2.00x | 800.0 | 2.00x |" in text
    assert "| `stock` | 100.0 | 0.50x |" in text
