"""The GPU run's scripts (tools/gpu, issue 40) checked on the CPU, without a GPU: every
shell script parses; issue40.sh plans its items in the issue's priority order within its
budget and refuses bad arguments; pack.sh's dry run names `./fork setup` before the sdist
is needed; gpu_ttft.py's plan carries the boundary recompute only where it applies; the
TTFT ratios are the quotients of the logged medians (worked out by hand below)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "tools" / "gpu"


def _run(cmd, tmp_path, env=None):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(tmp_path / "out"), **(env or {})})


@pytest.mark.parametrize("script", sorted(p.name for p in GPU.glob("*.sh")))
def test_every_gpu_shell_script_parses(script):
    assert subprocess.run(["bash", "-n", str(GPU / script)]).returncode == 0


def test_issue40_plans_the_items_in_priority_order_within_the_budget(tmp_path):
    done = _run(["bash", str(GPU / "issue40.sh"), "--dry-run", "--budget", "2000"], tmp_path)
    assert done.returncode == 0, done.stderr
    items = [line.split(":")[0] for line in done.stdout.splitlines()[1:]
             if "dry-run, would run" in line]
    assert items == ["mla-triton", "mla-fa", "mla-flashmla", "ttft-chunk", "ttft-stock",
                     "ttft-k12", "k12-1step", "remap", "window-triton", "window-fa", "ttft-profile"]
    # Eight minutes: the first items run, the rest are skipped by name, nothing overruns.
    done = _run(["bash", str(GPU / "issue40.sh"), "--dry-run", "--budget", "480"], tmp_path)
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert any(line.startswith("mla-triton: dry-run") for line in lines)
    assert any(line.startswith("ttft-stock: skipped") for line in lines)
    assert lines[-1] == "total 480s of 480s"
    assert (tmp_path / "out" / "summary.txt").read_text().splitlines() == lines


def test_only_runs_the_named_items_in_the_order_given(tmp_path):
    # Issue 52 runs issue 40's items in its own priority: the TTFT rows first.
    done = _run(["bash", str(GPU / "issue40.sh"), "--dry-run", "--budget", "2000", "--only",
                 "ttft-chunk,ttft-stock,ttft-k12,k12-1step,mla-triton,window-triton"], tmp_path)
    assert done.returncode == 0, done.stderr
    items = [line.split(":")[0] for line in done.stdout.splitlines()[1:]
             if "dry-run, would run" in line]
    assert items == ["ttft-chunk", "ttft-stock", "ttft-k12", "k12-1step", "mla-triton",
                     "window-triton"]


@pytest.mark.parametrize("args", [["--only", "unit"], ["--budget", "0"], ["--bogus"]])
def test_issue40_refuses_bad_arguments(tmp_path, args):
    done = _run(["bash", str(GPU / "issue40.sh"), "--dry-run", *args], tmp_path)
    assert done.returncode == 2 and "issue40.sh" in done.stderr


def test_pack_dry_run_sets_the_fork_up_before_the_sdist_and_refuses_bad_arguments(tmp_path):
    done = _run(["bash", str(GPU / "pack.sh"), "--dry-run"], tmp_path,
                env={"FORK_CACHE": str(tmp_path / "fresh-cache")})
    steps = [line for line in done.stdout.splitlines() if line[:2] in ("1.", "2.", "3.", "4.")]
    assert steps[0].startswith("1. ./fork setup (no venv") and "fork apply vllm" in steps[-1]
    assert len(steps) == 4
    done = _run(["bash", str(GPU / "pack.sh"), "py", "--dry-run"], tmp_path)
    assert not any(line.startswith("3.") for line in done.stdout.splitlines())
    assert _run(["bash", str(GPU / "pack.sh"), "--nope"], tmp_path).returncode == 2


def _ttft_plan(tmp_path, mode, **env):
    done = _run([sys.executable, str(ROOT / "benchmarks" / "gpu_ttft.py"), mode, "/m"], tmp_path,
                env={"TTFT_DRY_RUN": "1", **env})
    return done, (json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else None)


def test_gpu_ttft_plans_the_recompute_on_the_chunk_engine_only(tmp_path):
    _, plan = _ttft_plan(tmp_path, "chunk", TTFT_SIZES="8192", TTFT_RECOMPUTE_K="12")
    assert plan["engine"]["chunk_recompute_tokens"] == 12 and plan["sizes"] == [8192]
    assert plan["engine"]["max_model_len"] == 8192 + 1024
    _, plan = _ttft_plan(tmp_path, "chunk", TTFT_SIZES="8192,32768")
    assert "chunk_recompute_tokens" not in plan["engine"]
    assert plan["engine"]["enable_chunk_cache"] and plan["sizes"] == [8192, 32768]
    _, plan = _ttft_plan(tmp_path, "stock", TTFT_SIZES="8192,32768", TTFT_REPS="5")
    assert plan["engine"]["enable_prefix_caching"] is False and plan["reps"] == 5
    assert "enable_chunk_cache" not in plan["engine"]
    done, _ = _ttft_plan(tmp_path, "stock", TTFT_RECOMPUTE_K="12")
    assert done.returncode != 0 and "needs mode chunk" in done.stderr


def test_ttft_ratios_are_the_quotients_of_the_logged_medians(tmp_path):
    chunk, stock, k12 = tmp_path / "ttft-chunk.log", tmp_path / "ttft-stock.log", \
        tmp_path / "ttft-k12.log"
    chunk.write_text("\n".join([
        "INFO some engine line {not json",
        json.dumps({"mode": "chunk", "start_up_s": 60.0}),
        json.dumps({"mode": "chunk", "size": 8192, "ttft_ms_median": 20.0,
                    "floor_ms_median": 10.0, "cached_tokens_mean": 8136,
                    "prompt_tokens_mean": 8192}),
        json.dumps({"mode": "chunk", "size": 32768, "ttft_ms_median": 30.0,
                    "floor_ms_median": 12.0})]))
    stock.write_text(json.dumps({"mode": "stock", "size": 8192, "ttft_ms_median": 250.0}))
    k12.write_text("\n".join(json.dumps(r) for r in [
        {"mode": "chunk", "size": 8192, "ttft_ms_median": 21.0, "engine_recompute_k": 12},
        {"mode": "chunk+K12", "size": 8192, "ttft_ms_median": 42.0,
         "engine_recompute_k": 12}]))
    done = _run([sys.executable, str(GPU / "ttft_ratios.py"), str(chunk), str(stock), str(k12),
                 str(tmp_path / "absent.log")], tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # 20 / 10 = 2.00x the floor (target 1.3x: not met); 250 / 20 = 12.5x below stock
    # (target 10x: met); the K = 12 engine's own sink (21 ms, not the 20 ms of the K = 0
    # engine): 42 / 21 = 2.00x; 32k: 30 / 12 = 2.50x the floor, stock missing.
    assert lines[0].startswith("8192 tokens: chunk 20.00 ms (cached 8136 of 8192)")
    assert "2.00x the floor (target <= 1.3x: NOT met)" in lines[0]
    assert "12.5x below stock (target >= 10.0x: met)" in lines[0]
    assert lines[1] == ("8192 tokens: sink+K12 42.00 ms vs sink 21.00 ms (same engine): 2.00x "
                        "(target <= 1.3x: NOT met)")
    assert "2.50x the floor (target <= 2.0x: NOT met)" in lines[2] and "stock missing" in lines[2]
    assert _run([sys.executable, str(GPU / "ttft_ratios.py")], tmp_path).returncode == 2
