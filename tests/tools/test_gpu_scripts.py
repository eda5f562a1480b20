"""The GPU run's scripts (tools/gpu, issues 40, 59, 60) checked on the CPU, without a
GPU: every shell script parses; issue40.sh and issue60.sh plan their items in the
issues' priority order within their budget and refuse bad arguments; pack.sh's dry run
names the CUDA wheel and its sha256; the parts it writes install exactly that wheel
through pip, a changed or missing part is refused, and a warm machine's site is
reinstalled unless it holds MANIFEST's wheel; phase_clock.py plans one chunk engine
with every phase (its real CPU run is marked slow: one engine start); gpu_ttft.py's
plan carries the boundary recompute only where it applies and APC-same on the
prefix-caching engine; the TTFT ratios are the quotients of the logged medians (worked
out by hand below)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "tools" / "gpu"


def _run(cmd, tmp_path, env=None):
    return subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OUT": str(tmp_path / "out"), **(env or {})},
    )


def _planned(stdout: str) -> list[str]:
    """The items a dry run says it would run, in its order."""
    return [
        line.split(":")[0]
        for line in stdout.splitlines()[1:]
        if "dry-run, would run" in line
    ]


@pytest.mark.parametrize("script", sorted(p.name for p in GPU.glob("*.sh")))
def test_every_gpu_shell_script_parses(script):
    assert subprocess.run(["bash", "-n", str(GPU / script)]).returncode == 0


def test_issue40_plans_the_items_in_priority_order_within_the_budget(tmp_path):
    done = _run(
        ["bash", str(GPU / "issue40.sh"), "--dry-run", "--budget", "2000"], tmp_path
    )
    assert done.returncode == 0, done.stderr
    items = _planned(done.stdout)
    assert items == [
        "mla-triton",
        "mla-fa",
        "mla-flashmla",
        "ttft-chunk",
        "ttft-stock",
        "ttft-k12",
        "k12-1step",
        "remap",
        "window-triton",
        "window-fa",
        "ttft-profile",
    ]
    # Eight minutes: the first items run, the rest are skipped by name, nothing
    # overruns.
    done = _run(
        ["bash", str(GPU / "issue40.sh"), "--dry-run", "--budget", "480"], tmp_path
    )
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert any(line.startswith("mla-triton: dry-run") for line in lines)
    assert any(line.startswith("ttft-stock: skipped") for line in lines)
    assert lines[-1] == "total 480s of 480s"
    assert (tmp_path / "out" / "summary.txt").read_text().splitlines() == lines


def test_only_runs_the_named_items_in_the_order_given(tmp_path):
    # Issue 52 runs issue 40's items in its own priority: the TTFT rows first.
    done = _run(
        [
            "bash",
            str(GPU / "issue40.sh"),
            "--dry-run",
            "--budget",
            "2000",
            "--only",
            "ttft-chunk,ttft-stock,ttft-k12,k12-1step,mla-triton,window-triton",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    items = _planned(done.stdout)
    assert items == [
        "ttft-chunk",
        "ttft-stock",
        "ttft-k12",
        "k12-1step",
        "mla-triton",
        "window-triton",
    ]


@pytest.mark.parametrize("args", [["--only", "unit"], ["--budget", "0"], ["--bogus"]])
def test_issue40_refuses_bad_arguments(tmp_path, args):
    done = _run(["bash", str(GPU / "issue40.sh"), "--dry-run", *args], tmp_path)
    assert done.returncode == 2 and "issue40.sh" in done.stderr


def test_pack_dry_run_names_the_cuda_wheel_and_its_sha256_and_refuses_bad_arguments(
    tmp_path,
):
    cache = tmp_path / "fresh-cache"
    done = _run(
        ["bash", str(GPU / "pack.sh"), "--dry-run"],
        tmp_path,
        env={"FORK_CACHE": str(cache)},
    )
    steps = [
        line
        for line in done.stdout.splitlines()
        if line[:2] in ("1.", "2.", "3.", "4.")
    ]
    assert steps[0].startswith(
        "1. ./fork build --device cuda --base 0.23 (no CUDA wheel"
    )
    assert "wheel: none yet, so no sha256" in done.stdout and len(steps) == 4
    # A wheel of the name `./fork build --device cuda` writes: its sha256, worked out
    # here.
    (cache / "dist").mkdir(parents=True)
    wheel = (
        cache
        / "dist"
        / "vllm-0.23.0+chunkcache.cu130-2-cp38-abi3-manylinux_2_28_x86_64.whl"
    )
    wheel.write_bytes(b"not really a wheel" * 1000)
    (
        cache
        / "dist"
        / "vllm-0.32.0+chunkcache.cu130-cp38-abi3-manylinux_2_28_x86_64.whl"
    ).write_bytes(b"x")
    done = _run(
        ["bash", str(GPU / "pack.sh"), "--dry-run"],
        tmp_path,
        env={"FORK_CACHE": str(cache)},
    )
    assert (
        f"wheel: {cache}/dist/{wheel.name} (18000 bytes) sha256 "
        f"{hashlib.sha256(wheel.read_bytes()).hexdigest()}" in done.stdout
    )
    assert "(1 parts of <= 58 MiB)" in done.stdout
    for bad in (["--base", "0.99"], ["--nope"], ["--base"], ["--assemble", "only-one"]):
        assert _run(["bash", str(GPU / "pack.sh"), *bad], tmp_path).returncode == 2, bad


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    """A minimal wheel pip installs: the files, WHEEL, METADATA and RECORD."""
    info = "fakevllm-1.0.dist-info"
    files = {
        **files,
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: fakevllm\nVersion: 1.0\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", record)
    return path


def test_the_carried_parts_install_exactly_the_wheel_and_refuse_a_changed_part(
    tmp_path,
):
    payload = os.urandom(6000)  # incompressible: several parts of 2000 bytes
    wheel = _wheel(
        tmp_path / "fakevllm-1.0-py3-none-any.whl",
        {"fakevllm/__init__.py": b"X = 1\n", "fakevllm/blob.bin": payload},
    )
    deps_dir = tmp_path / "deps-src" / "depmod"
    deps_dir.mkdir(parents=True)
    (deps_dir / "__init__.py").write_text("Y = 2\n")
    deps = tmp_path / "deps.tar.xz"
    subprocess.run(
        f"tar cf - -C {tmp_path / 'deps-src'} . | xz > {deps}", shell=True, check=True
    )
    parts = tmp_path / "parts"
    env = {
        "GPU_DIR": str(parts),
        "PART_BYTES": "2000",
        "FORK_CACHE": str(tmp_path / "cache"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = _run(
        ["bash", str(GPU / "pack.sh"), "--assemble", str(wheel), str(deps)],
        tmp_path,
        env,
    )
    assert done.returncode == 0, done.stderr
    manifest = (parts / "MANIFEST").read_text().splitlines()
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert manifest[0] == f"wheel {wheel.name} {digest}"
    names = sorted(p.name for p in parts.glob("part*"))
    assert len(names) >= 4 and [m.split()[1] for m in manifest[1:]] == names
    assert all((parts / n).stat().st_size <= 2000 for n in names)

    def install(tag):
        return _run(
            ["bash", str(GPU / "install.sh")],
            tmp_path,
            {
                **env,
                "STAGE": str(tmp_path / f"stage-{tag}"),
                "SITE": str(tmp_path / f"site-{tag}"),
            },
        )

    done = install("ok")
    assert done.returncode == 0, done.stdout + done.stderr
    site = tmp_path / "site-ok"
    # pip laid down the wheel's own bytes, and the dependencies beside them.
    assert (site / "fakevllm" / "blob.bin").read_bytes() == payload
    assert (site / "fakevllm-1.0.dist-info" / "RECORD").exists()
    assert (site / "depmod" / "__init__.py").read_text() == "Y = 2\n"
    assert (site / ".done").read_text().split() == [wheel.name, digest]
    assert f"sha256 {digest} (checked)" in done.stdout
    # A part that changed on the way: refused before anything is installed.
    stage = tmp_path / "stage-bad"
    stage.mkdir()
    for n in names:
        (stage / n).write_bytes((parts / n).read_bytes())
    (stage / "MANIFEST").write_text((parts / "MANIFEST").read_text())
    bad = bytearray((stage / names[1]).read_bytes())
    bad[10] ^= 1
    (stage / names[1]).write_bytes(bytes(bad))
    done = _run(
        ["bash", str(GPU / "install.sh")],
        tmp_path,
        {
            **env,
            "GPU_DIR": str(tmp_path / "none"),
            "STAGE": str(stage),
            "SITE": str(tmp_path / "site-bad"),
        },
    )
    assert done.returncode == 4 and f"{names[1]} differs from MANIFEST" in done.stderr
    assert not (tmp_path / "site-bad" / "fakevllm").exists()
    # A part not carried: named.
    (stage / names[1]).unlink()
    done = _run(
        ["bash", str(GPU / "install.sh")],
        tmp_path,
        {
            **env,
            "GPU_DIR": str(tmp_path / "none"),
            "STAGE": str(stage),
            "SITE": str(tmp_path / "site-bad"),
        },
    )
    assert done.returncode == 3 and f"{names[1]} missing" in done.stderr


def test_a_warm_site_is_reinstalled_unless_done_names_the_manifests_wheel(tmp_path):
    """A warm machine keeps /tmp/gpu and /tmp/site: a rebuilt wheel of the same name
    replaces the one installed before; the same wheel again is kept."""
    deps_dir = tmp_path / "deps-src" / "depmod"
    deps_dir.mkdir(parents=True)
    (deps_dir / "__init__.py").write_text("Y = 2\n")
    deps = tmp_path / "deps.tar.xz"
    subprocess.run(
        f"tar cf - -C {tmp_path / 'deps-src'} . | xz > {deps}", shell=True, check=True
    )
    path = sys.executable
    base = {"PART_BYTES": "2000", "FORK_CACHE": str(tmp_path / "cache")}
    base["PATH"] = f"{Path(path).parent}:{os.environ['PATH']}"
    warm = {"STAGE": str(tmp_path / "stage"), "SITE": str(tmp_path / "site")}
    site = tmp_path / "site"

    def carry_and_install(tag, files):
        built = tmp_path / tag
        built.mkdir()
        wheel = _wheel(built / "fakevllm-1.0-py3-none-any.whl", files)
        parts = {**base, "GPU_DIR": str(tmp_path / f"parts-{tag}")}
        cmd = ["bash", str(GPU / "pack.sh"), "--assemble", str(wheel), str(deps)]
        packed = _run(cmd, tmp_path, parts)
        assert packed.returncode == 0, packed.stderr
        done = _run(["bash", str(GPU / "install.sh")], tmp_path, {**parts, **warm})
        assert done.returncode == 0, done.stdout + done.stderr
        return hashlib.sha256(wheel.read_bytes()).hexdigest(), done.stdout

    old = {"fakevllm/__init__.py": b"X = 1\n", "fakevllm/old.py": b"OLD = 1\n"}
    old_digest, _ = carry_and_install("old", old)
    assert (site / ".done").read_text().split()[1] == old_digest
    new_digest, out = carry_and_install("new", {"fakevllm/__init__.py": b"X = 2\n"})
    assert new_digest != old_digest
    assert f"not MANIFEST's fakevllm-1.0-py3-none-any.whl {new_digest}" in out
    assert (site / ".done").read_text().split() == [
        "fakevllm-1.0-py3-none-any.whl",
        new_digest,
    ]
    assert (site / "fakevllm" / "__init__.py").read_text() == "X = 2\n"
    assert not (site / "fakevllm" / "old.py").exists()  # nothing of the old wheel
    assert (site / "depmod" / "__init__.py").read_text() == "Y = 2\n"
    # The same MANIFEST again: kept as it is.
    again = _run(
        ["bash", str(GPU / "install.sh")],
        tmp_path,
        {**base, "GPU_DIR": str(tmp_path / "parts-new"), **warm},
    )
    assert again.returncode == 0, again.stderr
    assert f"already holds fakevllm-1.0-py3-none-any.whl {new_digest}" in again.stdout


def test_issue60_plans_install_check_profile_then_speed_then_exactness(tmp_path):
    done = _run(
        ["bash", str(GPU / "issue60.sh"), "--dry-run", "--budget", "3000"], tmp_path
    )
    assert done.returncode == 0, done.stderr
    items = _planned(done.stdout)
    assert items == [
        "serve",
        "profile",
        "profile-b128",
        "ttft-8k",
        "ttft-32k",
        "k12-1step",
        "exact-bf16-fa",
        "exact-fp16-fa",
        "exact-bf16-triton",
        "exact-fp16-triton",
    ]
    done = _run(
        ["bash", str(GPU / "issue60.sh"), "--dry-run", "--budget", "540"], tmp_path
    )
    lines = done.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines if "dry-run, would run" in ln] == [
        "serve",
        "profile",
    ]
    assert any(ln.startswith("profile-b128: skipped") for ln in lines)
    assert lines[-1] == "total 540s of 540s"
    for bad in (["--only", "remap"], ["--budget", "x"]):
        done = _run(["bash", str(GPU / "issue60.sh"), "--dry-run", *bad], tmp_path)
        assert done.returncode == 2 and "issue60.sh" in done.stderr


def _phase_plan(tmp_path, *args):
    return _run(
        [sys.executable, str(GPU / "phase_clock.py"), "/m", "--plan", *args], tmp_path
    )


def test_phase_clock_plans_one_chunk_engine_with_every_phase(tmp_path):
    done = _phase_plan(
        tmp_path,
        "--sizes",
        "8192,32768",
        "--block-size",
        "128",
        "--trace-sizes",
        "32768",
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout.splitlines()[-1])
    assert plan["engine"]["enable_chunk_cache"] and plan["engine"]["block_size"] == 128
    assert plan["engine"]["max_model_len"] == 32768 + 1024 and plan["trace_sizes"] == [
        32768
    ]
    assert plan["device_timed"] == ["execute.load", "execute.forward"]
    for phase in (
        "add.render",
        "add.request_hashing",
        "schedule",
        "execute.state_update",
        "execute.prepare_inputs",
        "execute.attn_metadata",
        "execute.load",
        "execute.forward",
        "sample",
        "output.process_outputs",
    ):
        assert phase in plan["phases"]
    assert "block_size" not in json.loads(_phase_plan(tmp_path).stdout)["engine"]
    assert _phase_plan(tmp_path, "--reps", "0").returncode == 2


@pytest.mark.slow  # NOTE: one CPU engine start, ~75 s on a loaded 2-core machine
def test_phase_clock_runs_on_the_cpu_and_its_phases_add_up(tmp_path):
    models = Path(os.environ.get("FORK_MODELS", ROOT / ".cache" / "models"))
    done = subprocess.run(
        [
            sys.executable,
            str(GPU / "phase_clock.py"),
            str(models / "tiny-llama"),
            "--sizes",
            "2048",
            "--reps",
            "2",
            "--dtype",
            "float32",
            "--eager",
            "--trace-dir",
            str(tmp_path / "traces"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = next(
        json.loads(ln)
        for ln in done.stdout.splitlines()
        if ln.startswith('{"phase_clock": true')
    )
    assert row["cuda_event_ms"] == "n/a on cpu"
    for name in ("all-hit", "floor"):
        ms = row["ms"][name]
        top = sum(
            ms[p]
            for p in (
                "add",
                "schedule",
                "execute",
                "sample",
                "output.update_from_output",
                "output.process_outputs",
                "other",
            )
        )
        assert (
            abs(top - ms["ttft"]) < 0.01 + 1e-3 * ms["ttft"]
        )  # medians of sums, rounded
        assert ms["execute.forward"] > 0 and ms["schedule"] > 0
    hit = row["counts"]["all-hit"]
    assert (
        hit["load_rows"] == hit["cached_tokens"] > 0
        and "load_rows" not in row["counts"]["floor"]
    )
    assert "execute.load (cuda events)    n/a on cpu" in done.stdout
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "trace-all-hit-2048-b128.json.gz",
        "trace-floor-2048-b128.json.gz",
    ]


def _ttft_plan(tmp_path, mode, **env):
    done = _run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_ttft.py"), mode, "/m"],
        tmp_path,
        env={"TTFT_DRY_RUN": "1", **env},
    )
    return done, (
        json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else None
    )


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
    _, plan = _ttft_plan(tmp_path, "apc", TTFT_SIZES="8192")
    assert (
        plan["engine"]["enable_prefix_caching"] is True
        and "enable_chunk_cache" not in plan["engine"]
    )
    done, _ = _ttft_plan(tmp_path, "stock", TTFT_RECOMPUTE_K="12")
    assert done.returncode != 0 and "needs mode chunk" in done.stderr


def test_ttft_ratios_are_the_quotients_of_the_logged_medians(tmp_path):
    chunk, stock, k12 = (
        tmp_path / "ttft-chunk.log",
        tmp_path / "ttft-stock.log",
        tmp_path / "ttft-k12.log",
    )
    chunk.write_text(
        "\n".join(
            [
                "INFO some engine line {not json",
                json.dumps({"mode": "chunk", "start_up_s": 60.0}),
                json.dumps(
                    {
                        "mode": "chunk",
                        "size": 8192,
                        "ttft_ms_median": 20.0,
                        "floor_ms_median": 10.0,
                        "cached_tokens_mean": 8136,
                        "prompt_tokens_mean": 8192,
                    }
                ),
                json.dumps(
                    {
                        "mode": "chunk",
                        "size": 32768,
                        "ttft_ms_median": 30.0,
                        "floor_ms_median": 12.0,
                    }
                ),
            ]
        )
    )
    stock.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"mode": "stock", "size": 8192, "ttft_ms_median": 250.0},
                {
                    "mode": "apc",
                    "size": 8192,
                    "ttft_ms_median": 16.0,
                    "cached_tokens_mean": 8176,
                },
            ]
        )
    )
    k12.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "mode": "chunk",
                    "size": 8192,
                    "ttft_ms_median": 21.0,
                    "engine_recompute_k": 12,
                },
                {
                    "mode": "chunk+K12",
                    "size": 8192,
                    "ttft_ms_median": 42.0,
                    "engine_recompute_k": 12,
                },
            ]
        )
    )
    done = _run(
        [
            sys.executable,
            str(GPU / "ttft_ratios.py"),
            str(chunk),
            str(stock),
            str(k12),
            str(tmp_path / "absent.log"),
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # 20 / 10 = 2.00x the floor (target 1.3x: not met); 250 / 20 = 12.5x below stock
    # (target 10x: met); the K = 12 engine's own sink (21 ms, not the 20 ms of the K = 0
    # engine): 42 / 21 = 2.00x; 32k: 30 / 12 = 2.50x the floor, stock missing.
    assert lines[0].startswith("8192 tokens: chunk 20.00 ms (cached 8136 of 8192)")
    assert "2.00x the floor (target <= 1.3x: NOT met)" in lines[0]
    assert "12.5x below stock (target >= 10.0x: met)" in lines[0]
    # APC-same 16 ms: 20 / 16 = 1.25x (target 1.2x: not met); none logged at 32k.
    assert (
        "APC-same 16.00 ms (cached 8176): chunk 1.25x APC-same "
        "(target <= 1.2x: NOT met)" in lines[0]
    )
    assert "APC-same" not in lines[2]
    assert lines[1] == (
        "8192 tokens: sink+K12 42.00 ms vs sink 21.00 ms (same engine): 2.00x "
        "(target <= 1.3x: NOT met)"
    )
    assert (
        "2.50x the floor (target <= 2.0x: NOT met)" in lines[2]
        and "stock missing" in lines[2]
    )
    assert _run([sys.executable, str(GPU / "ttft_ratios.py")], tmp_path).returncode == 2
