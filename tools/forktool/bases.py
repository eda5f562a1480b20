"""Upstream bases as file sources: an sdist (tar.gz) or a wheel (zip), read without unpacking."""

from __future__ import annotations

import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .fetch import artifact_path
from .paths import Paths
from .pins import load_pins
from .progress import ToolError
from .releases import DEFAULT, RELEASES

# The default release's trees: tree name -> base kind -> pin name (see releases.py).
TREE_BASES = RELEASES[DEFAULT].trees


@dataclass(frozen=True)
class Base:
    # Tree this base belongs to ("vllm" or "vllm-ascend").
    tree: str
    # Release it is a base of ("0.23", "0.32").
    release: str
    # "sdist" or "wheel".
    kind: str
    # The verified artifact on disk.
    path: Path

    def label(self) -> str:
        return f"{self.tree} {self.release} ({self.kind}: {self.path.name})"

    def iter_files(self) -> Iterable[tuple[str, bytes]]:
        """Yield (tree-relative path, content) for every regular file of the base.

        NOTE: an sdist's single top-level directory is stripped so that tree paths start at
        the package (`vllm/...`), like a wheel's. Compiled libraries and the wheel's
        dist-info are left out: no patch may touch them, and they would make the git tree
        hundreds of MB larger.
        """
        for name, reader in self._members():
            if _is_skipped(name):
                continue
            yield name, reader()

    def read_files(self, wanted: set[str]) -> dict[str, bytes]:
        return {name: reader() for name, reader in self._members() if name in wanted}

    def _members(self):
        if self.kind == "sdist":
            with tarfile.open(self.path, "r:gz") as tar:
                for m in tar:
                    if not m.isfile():
                        continue
                    parts = m.name.split("/", 1)
                    if len(parts) != 2:
                        continue
                    yield parts[1], (lambda m=m: tar.extractfile(m).read())
        else:
            with zipfile.ZipFile(self.path) as zf:
                for info in zf.infolist():
                    if info.is_dir():
                        continue
                    yield info.filename, (lambda n=info.filename: zf.read(n))


def _is_skipped(name: str) -> bool:
    return name.endswith(".so") or ".dist-info/" in name


def pin_name(paths: Paths, tree: str, kind: str) -> str:
    """The pins.toml entry of `tree`'s `kind` base in the release `paths` works on."""
    try:
        return paths.base.trees[tree][kind]
    except KeyError:
        raise ToolError(f"no base {kind!r} for tree {tree!r} in release {paths.base.name}; "
                        f"known: {paths.base.trees}") from None


def base_for(paths: Paths, tree: str, kind: str) -> Base:
    pin = load_pins(paths.pins_file)[pin_name(paths, tree, kind)]
    path = artifact_path(paths, pin)
    if not path.exists():
        raise ToolError(f"{pin.file} is not downloaded yet: run "
                        f"`./fork fetch --base {paths.base.name}` first")
    return Base(tree=tree, release=paths.base.name, kind=kind, path=path)
