"""Where things live. Everything fetched or built goes under the ignored `.cache/`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from .releases import Release, release

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Paths:
    repo: Path
    # Root of every fetched or built artifact; `FORK_CACHE` moves it (e.g. onto a bigger disk).
    cache: Path
    # The upstream release this invocation works on (`--base`, else FORK_BASE, else 0.23).
    base: Release = field(default_factory=release)
    # The device the venv is for: "cpu" (.cache/venv) or "cuda" (.cache/venv-cuda); the
    # trees, series and downloads are the same for both.
    device: str = "cpu"
    # The CPU tier of a base without a CPU build: its CUDA venv (device "cuda") run on the
    # CPU under vLLM's CPU platform (env.runtime_env), for what needs no engine.
    cpu_tier: bool = False

    @classmethod
    def default(cls, base: str | None = None, device: str = "cpu") -> "Paths":
        return cls(repo=REPO, cache=Path(os.environ.get("FORK_CACHE", REPO / ".cache")),
                   base=release(base), device=device)

    def for_base(self, base: Release) -> "Paths":
        return replace(self, base=base)

    @property
    def downloads(self) -> Path:
        return self.cache / "downloads"

    @property
    def trees(self) -> Path:
        return self.cache / f"trees{self.base.suffix}"

    @property
    def dist(self) -> Path:
        return self.cache / "dist"

    @property
    def venv(self) -> Path:
        device = "" if self.device == "cpu" else f"-{self.device}"
        return self.cache / f"venv{self.base.suffix}{device}"

    @property
    def models(self) -> Path:
        return self.cache / "models"

    @property
    def pins_file(self) -> Path:
        return self.repo / "pins.toml"

    def patches_dir(self, tree: str) -> Path:
        return self.repo / "patches" / f"{tree}{self.base.suffix}"

    def overlay_dir(self, tree: str) -> Path:
        # The overlay of a tree is the repo folder named like the upstream package dir,
        # i.e. repo `vllm/` for the vLLM tree and repo `vllm-ascend/` (holding
        # `vllm_ascend/...`) for the vllm-ascend tree.
        return self.repo / OVERLAY_ROOTS[tree]

    def venv_python(self) -> Path:
        return self.venv / "bin" / "python"


# tree name -> (repo overlay dir, path prefix the overlay maps to inside the tree)
OVERLAY_ROOTS = {"vllm": "vllm", "vllm-ascend": "vllm-ascend"}
OVERLAY_PREFIX = {"vllm": "vllm", "vllm-ascend": ""}
