"""apply / export: materialise a tree as git commits, and turn its commits back into patches.

A materialised tree (.cache/trees/<tree>) is a git repository:
  upstream commit (tag `upstream`) -> one commit per patch, in series order -> overlay commit.
Files that do not exist upstream are overlay files (repo `vllm/`, `vllm-ascend/`); edits of
upstream files are patches. Export follows the same rule, whatever commit a change is in.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .bases import Base
from .git import apply_patch, git
from .paths import OVERLAY_PREFIX, Paths
from .progress import ToolError, say, step
from .series import Patch, load_patches, render_series, slug

OVERLAY_MESSAGE = "overlay: the fork's new modules (copied from the repository, not a patch)"


def tree_dir(paths: Paths, tree: str, kind: str) -> Path:
    return paths.trees / (tree if kind == "sdist" else f"{tree}-{kind}")


def overlay_files(paths: Paths, tree: str) -> dict[str, Path]:
    """Tree-relative path -> file in the repository, for every overlay file of `tree`."""
    root = paths.overlay_dir(tree)
    prefix = OVERLAY_PREFIX[tree]
    out = {}
    if not root.exists():
        return out
    for f in sorted(root.rglob("*")):
        if not f.is_file() or "__pycache__" in f.parts or f.suffix == ".pyc":
            continue
        rel = f.relative_to(root).as_posix()
        out[f"{prefix}/{rel}" if prefix else rel] = f
    return out


def init_upstream(dest: Path, base: Base) -> None:
    """`dest` (new) as a git repository of the base's files: one commit, tag `upstream`."""
    dest.mkdir(parents=True)
    for name, data in base.iter_files():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    git(dest, "init", "-q")
    # Upstream trees may carry their own .gitignore files; force-add so every file is in.
    git(dest, "add", "-A", "-f")
    git(dest, "commit", "-q", "-m", f"upstream: {base.label()}")
    git(dest, "tag", "upstream")


def apply(paths: Paths, base: Base, *, force: bool) -> Path:
    dest = tree_dir(paths, base.tree, base.kind)
    if dest.exists():
        if not force:
            raise ToolError(f"{dest} already exists. Export your edits (`./fork export`) and "
                            "re-run with --force to rebuild it from scratch.")
        shutil.rmtree(dest)
    with step(f"materialising {base.label()} into {dest}"):
        init_upstream(dest, base)
    for patch in load_patches(paths.patches_dir(base.tree)):
        problem = apply_patch(dest, patch.diff, index=True)
        if problem:
            raise ToolError(f"{patch.name} does not apply to {base.label()}:\n{problem}")
        git(dest, "commit", "-q", "-m", patch.message)
    overlay = overlay_files(paths, base.tree)
    upstream = set(git(dest, "ls-files").splitlines())
    clash = sorted(set(overlay) & upstream)
    if clash:
        raise ToolError(f"overlay files replace upstream files (make them patches): {clash}")
    for rel, src in overlay.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    if overlay:
        git(dest, "add", "-A", "-f", *overlay)
        git(dest, "commit", "-q", "-m", OVERLAY_MESSAGE)
    say(f"{dest}: {len(load_patches(paths.patches_dir(base.tree)))} patches, "
        f"{len(overlay)} overlay files")
    return dest


def export(paths: Paths, tree: str, src: Path) -> list[str]:
    """Write the tree's commits back as patches + series, and its new files as the overlay.

    Returns the files of the repository that changed (empty when nothing did).
    """
    if git(src, "status", "--porcelain", "--untracked-files=all").strip():
        raise ToolError(f"{src} has uncommitted changes: commit them (one commit per logical "
                        "change, message = patch header) before exporting")
    upstream = set(git(src, "ls-tree", "-r", "--name-only", "upstream").splitlines())
    commits = git(src, "rev-list", "--reverse", "upstream..HEAD").split()
    patches: list[Patch] = []
    for commit in commits:
        changed = git(src, "diff-tree", "--no-commit-id", "--name-only", "-r", "--no-renames",
                      commit).splitlines()
        touched = [p for p in changed if p in upstream]
        if not touched:
            continue  # overlay-only commit
        message = git(src, "log", "-1", "--format=%B", commit).rstrip("\n")
        diff = git(src, "diff", "--full-index", "--no-color", "--no-ext-diff", "--no-renames",
                   "--src-prefix=a/", "--dst-prefix=b/", f"{commit}^", commit, "--", *touched)
        name = f"{len(patches) + 1:04d}-{slug(message.split(chr(10), 1)[0])}.patch"
        patches.append(Patch(name=name, message=message, diff=diff))
    changed_files = _write_patches(paths.patches_dir(tree), patches)
    changed_files += _write_overlay(paths, tree, src, upstream)
    return changed_files


def _write_if_changed(path: Path, data: bytes, changed: list[str]) -> None:
    if path.exists() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    changed.append(str(path))


def _write_patches(patch_dir: Path, patches: list[Patch]) -> list[str]:
    changed: list[str] = []
    patch_dir.mkdir(parents=True, exist_ok=True)
    for p in patches:
        _write_if_changed(patch_dir / p.name, p.render().encode(), changed)
    _write_if_changed(patch_dir / "series", render_series([p.name for p in patches]).encode(),
                      changed)
    keep = {p.name for p in patches}
    for stale in sorted(patch_dir.glob("*.patch")):
        if stale.name not in keep:
            stale.unlink()
            changed.append(f"{stale} (removed)")
    return changed


def _write_overlay(paths: Paths, tree: str, src: Path, upstream: set[str]) -> list[str]:
    """Copy the tree's new files to the repository's overlay.

    NOTE: the repository's overlay may have been edited since the tree was applied (the
    tree's overlay commit is that snapshot). Such a file is never overwritten or removed:
    if the tree changed it too, export refuses; otherwise the repository's version stays.
    """
    changed: list[str] = []
    prefix = OVERLAY_PREFIX[tree]
    root = paths.overlay_dir(tree)
    new_files = [p for p in git(src, "ls-tree", "-r", "--name-only", "HEAD").splitlines()
                 if p not in upstream]
    wanted: dict[str, str] = {}
    for rel in new_files:
        if prefix and not rel.startswith(prefix + "/"):
            raise ToolError(f"new file {rel} is outside {prefix}/: the overlay of {tree} only "
                            f"holds files under {prefix}/")
        wanted[rel[len(prefix) + 1:] if prefix else rel] = rel
    snapshot = _overlay_snapshot(src)
    repo_files = {(rel[len(prefix) + 1:] if prefix else rel): path
                  for rel, path in overlay_files(paths, tree).items()}
    conflicts, kept = [], []
    writes: dict[Path, bytes] = {}
    removals: list[Path] = []
    for repo_rel, tree_rel in sorted(wanted.items()):
        data = git_show_bytes(src, f"HEAD:{tree_rel}")
        path = root / repo_rel
        repo_data = path.read_bytes() if path.exists() else None
        before = snapshot.get(tree_rel)
        if repo_data is not None and repo_data != before and repo_data != data:
            if data != before:
                conflicts.append(repo_rel)
            else:
                kept.append(repo_rel)
            continue
        writes[path] = data
    for repo_rel, path in repo_files.items():
        if repo_rel in wanted:
            continue
        tree_rel = f"{prefix}/{repo_rel}" if prefix else repo_rel
        if tree_rel in snapshot and snapshot[tree_rel] == path.read_bytes():
            removals.append(path)  # deleted in the tree
        else:
            kept.append(repo_rel)  # new or edited in the repository since apply
    if conflicts:
        raise ToolError(
            "export would overwrite overlay files edited in the repository since "
            f"`./fork apply` (and in the tree too): {conflicts}. Merge them by hand (copy "
            "the repository's version into the tree and commit there), then export again")
    for path, data in writes.items():
        _write_if_changed(path, data, changed)
    for path in removals:
        path.unlink()
        changed.append(f"{path} (removed)")
    if kept:
        say(f"export: kept the repository's newer version of {len(kept)} overlay file(s): "
            + ", ".join(sorted(kept)[:6]) + (" ..." if len(kept) > 6 else ""))
    return changed


def _overlay_snapshot(src: Path) -> dict[str, bytes]:
    """Overlay files as the tree was applied with (its overlay commit), by tree path."""
    commit = git(src, "log", "-1", "--format=%H", "--fixed-strings",
                 f"--grep={OVERLAY_MESSAGE}", "HEAD").strip()
    if not commit:
        return {}
    files = git(src, "diff-tree", "--no-commit-id", "--name-only", "-r", "--root",
                commit).splitlines()
    return {rel: git_show_bytes(src, f"{commit}:{rel}") for rel in files}


def git_show_bytes(cwd: Path, spec: str) -> bytes:
    return subprocess.run(["git", "show", spec], cwd=cwd, capture_output=True,
                          check=True).stdout
