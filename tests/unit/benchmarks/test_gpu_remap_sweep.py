"""benchmarks/gpu_remap.py's launch-geometry sweep (issue 40, deliverable 1) on the CPU:
which geometries it times (around the default, the best of the 2026-11-26 H100 sweep),
its argument parsing, and one run of the sweep itself in Triton's interpreter on tiny
shapes: every geometry writes the default's bytes, and a geometry that writes other
bytes is reported (the sweep returns False). The timings are the GPU's business (not
executed here); a stub timer stands in."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton compiles anything

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

fused = pytest.importorskip("vllm.v1.worker.fused_chunk_load")

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_remap.py"
_spec = importlib.util.spec_from_file_location("gpu_remap", _PATH)
remap = importlib.util.module_from_spec(_spec)
sys.modules["gpu_remap"] = remap
_spec.loader.exec_module(remap)


def _triples(geometries):
    return {(g.rows_per_program, g.heads_per_program, g.num_warps) for g in geometries}


def test_the_default_is_the_measured_best_and_the_quick_sweep_surrounds_it():
    # The second H100 sweep of 2026-11-26 (docs/gpu.md): load 76.7%, capture 86.1%.
    assert fused.LaunchGeometry(4, 2, 2) == fused.DEFAULT_LOAD_GEOMETRY
    assert fused.LaunchGeometry(8, 1, 2) == fused.DEFAULT_CAPTURE_GEOMETRY
    quick = remap.sweep_geometries("quick")
    assert len(quick) == len(set(quick))
    assert _triples(quick) == {
        (r, h, w) for r in (4, 8, 16, 32) for h in (1, 2) for w in (2, 4, 8)
    } | {(1, 1, None)}
    full = remap.sweep_geometries("full")
    assert len(full) == len(set(full)) and {
        fused.DEFAULT_LOAD_GEOMETRY,
        fused.DEFAULT_CAPTURE_GEOMETRY,
    } <= set(full)
    assert _triples(quick) - {(1, 1, None)} <= _triples(full)
    assert all(g.rows_per_program * g.heads_per_program <= 64 for g in full)


@pytest.mark.parametrize("argv", [["--sweep-only"], ["--sweep", "wide"]])
def test_bad_arguments_are_refused_before_any_gpu_work(argv):
    with pytest.raises(SystemExit) as e:
        remap.main(argv)
    assert e.value.code == 2


def _tiny(monkeypatch):
    for name, value in dict(
        LAYERS=1, KV_HEADS=2, HEAD=32, BLOCK=16, POOL_ROWS=256, KV_BLOCKS=1004
    ).items():
        monkeypatch.setattr(remap, name, value)


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "one-geometry-off"])
def test_the_sweep_runs_on_tiny_shapes_and_flags_a_geometry_that_writes_other_bytes(
    vllm_config_context, monkeypatch, capsys, broken
):
    _tiny(monkeypatch)
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.v1.worker.position_remapper import RopeRotation

    rotation = RopeRotation(
        RotaryEmbedding(32, 32, 8192, 500000.0, True, torch.float32),
        use_cpu_kernel=False,
    )
    gen = torch.Generator().manual_seed(0)
    pool_k = [torch.randn(256, 2, 32, generator=gen).bfloat16()]
    pool_v = [torch.randn(256, 2, 32, generator=gen).bfloat16()]
    caches = [torch.full((1004, 2, 16, 2, 32), float("nan"), dtype=torch.bfloat16)]
    group = fused.FusedGroup.of(
        pool_k, pool_v, [fused.PagedLayer(c[:, 0], c[:, 1]) for c in caches]
    )
    # Two geometries besides the default, of few programs each (the interpreter runs
    # ~20 programs a second): the quick sweep's largest tile, and 16 rows x 2 heads.
    odd = fused.LaunchGeometry(32, 2, 8)
    monkeypatch.setattr(
        remap, "sweep_geometries", lambda kind: [fused.LaunchGeometry(16, 2, 2), odd]
    )
    if broken:
        real_load = fused.fused_load

        def off_by_one_row(group, src, slots, *args, geometry):
            # This geometry drops the step's last row: the sweep must see it.
            n = len(src) - (geometry == odd)
            real_load(
                group, src[:n], slots[:n], args[0][:n], *args[1:], geometry=geometry
            )

        monkeypatch.setattr(fused, "fused_load", off_by_one_row)
    ok = remap.sweep(
        "quick",
        group,
        caches,
        pool_k,
        pool_v,
        rotation,
        bw=1e12,
        dev=torch.device("cpu"),
        row_counts=(36,),
        time_fn=lambda fn, reps: (fn(), 1e-3)[1],
    )
    out = capsys.readouterr().out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.startswith(("load", "capture"))
    ]
    assert len(rows) == 2 * 3  # load and capture, the default and the two others
    same = {(r[0], r[2], r[3], r[4]): r[-1] for r in rows}
    want_load_odd = "False" if broken else "True"
    assert same[("load", "32", "2", "8")] == want_load_odd
    assert same[("load", "4", "2", "2")] == same[("load", "16", "2", "2")] == "True"
    assert all(same[k] == "True" for k in same if k[0] == "capture")
    assert ok is not broken
    assert "best load geometry" in out and "best capture geometry" in out
