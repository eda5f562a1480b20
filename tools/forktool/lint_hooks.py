"""A base's pre-commit hooks, read from its own `.pre-commit-config.yaml` (for `./fork lint`).

pre-commit itself cannot run here: it clones every hook repository from GitHub. So the
hooks are read from the config, the pinned tools are installed from PyPI (ruff-pre-commit's
rev v0.14.0 -> ruff==0.14.0, ...), and each hook is run as pre-commit would run it: its entry,
its args, the files its `files`/`exclude`/`types` filter selects.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .progress import ToolError

# What pre-commit would read from a remote hook repository's .pre-commit-hooks.yaml: the
# entry, the file filter and the PyPI package that provides the tool (its version is the
# config's rev). Hooks of other repositories are listed as not applicable when they match
# none of the files, and fail the run when they match one (nothing here can run them).
REMOTE_HOOKS: dict[str, dict] = {
    "ruff-check": {"entry": "ruff check --force-exclude", "package": "ruff",
                   "types_or": ("python", "pyi", "jupyter"), "kind": "ruff-check"},
    "ruff": {"entry": "ruff check --force-exclude", "package": "ruff",
             "types_or": ("python", "pyi", "jupyter"), "kind": "ruff-check"},
    "ruff-format": {"entry": "ruff format --force-exclude", "package": "ruff",
                    "types_or": ("python", "pyi", "jupyter"), "kind": "ruff-format"},
    "typos": {"entry": "typos", "package": "typos", "types": ("text",), "kind": "typos"},
    "codespell": {"entry": "codespell", "package": "codespell", "types": ("text",),
                  "kind": "codespell"},
    "clang-format": {"types_or": ("c++", "c", "c#", "cuda", "java", "javascript", "json",
                                  "objective-c", "proto", "textproto")},
    "markdownlint-cli2": {"types": ("markdown",)},
    "markdownlint": {"types": ("markdown",)},
    "actionlint": {"files": r"^\.github/workflows/.*\.ya?ml$"},
    "shellcheck": {"types": ("shell",)},
    "pip-compile": {"files": r"^requirements\.(in|txt)$"},
    "check-json": {"types": ("json",)},
}

# identify's tags (pre-commit's `types`), by file extension, for the files the fork has.
EXTENSION_TAGS = {
    ".py": {"python"}, ".pyi": {"pyi"}, ".ipynb": {"jupyter", "json"},
    ".c": {"c"}, ".h": {"c", "c++", "header"}, ".cc": {"c++"}, ".cpp": {"c++"},
    ".hpp": {"c++", "header"}, ".cu": {"cuda"}, ".cuh": {"cuda"}, ".sh": {"shell", "bash"},
    ".md": {"markdown"}, ".json": {"json"}, ".yaml": {"yaml"}, ".yml": {"yaml"},
    ".toml": {"toml"}, ".txt": {"plain-text"}, ".rs": {"rust"}, ".proto": {"proto"},
    ".png": {"png", "image"}, ".so": {"binary"},
}


@dataclass(frozen=True)
class Hook:
    # The hook's id (its alias where it has one: pip-compile has several).
    id: str
    # "local" or the last part of the repository URL ("ruff-pre-commit").
    repo: str
    # The repository's rev; "" for local hooks.
    rev: str
    # "ruff-check", "ruff-format", "typos", "codespell" (a pinned tool from PyPI), "local"
    # (the base's own command), or "" (a remote hook nothing here runs).
    kind: str
    # The command line: entry + args (without the file names).
    argv: tuple[str, ...] = ()
    language: str = ""
    files: str = ""
    exclude: str = "^$"
    types: tuple[str, ...] = ("file",)
    types_or: tuple[str, ...] = ()
    exclude_types: tuple[str, ...] = ()
    pass_filenames: bool = True
    always_run: bool = False
    stages: tuple[str, ...] = ()
    # The PyPI requirements the hook runs with (the pinned tool, additional_dependencies).
    requirements: tuple[str, ...] = ()

    @property
    def is_mypy(self) -> bool:
        return self.kind == "local" and any(a.endswith("mypy.py") for a in self.argv)

    def selects(self, path: str, global_exclude: str = "^$") -> bool:
        """Whether pre-commit would pass `path` to this hook (its files/exclude/types)."""
        if re.search(global_exclude, path) or re.search(self.exclude, path):
            return False
        if self.files and not re.search(self.files, path):
            return False
        tags = file_tags(path)
        if not set(self.types) <= tags:
            return False
        if self.types_or and not set(self.types_or) & tags:
            return False
        return not set(self.exclude_types) & tags


@dataclass(frozen=True)
class HookConfig:
    hooks: tuple[Hook, ...]
    # The config's top-level `exclude`.
    exclude: str = "^$"

    def requirements(self) -> tuple[str, ...]:
        """Every runnable hook's requirements, sorted: what the lint venv holds."""
        reqs = {r for h in self.hooks for r in h.requirements}
        return tuple(sorted(reqs, key=str.lower))

    def in_stage(self, stage: str) -> list[Hook]:
        return [h for h in self.hooks if stage in h.stages]


def file_tags(path: str) -> set[str]:
    suffix = PurePosixPath(path).suffix.lower()
    tags = {"file"} | EXTENSION_TAGS.get(suffix, set())
    if "binary" not in tags and "png" not in tags:
        tags.add("text")
    return tags


def rev_version(rev: str) -> str:
    """A hook repository's rev as the version of its PyPI package (v0.14.0 -> 0.14.0)."""
    version = rev[1:] if rev.startswith("v") else rev
    if not re.fullmatch(r"\d+(\.\d+)*", version):
        raise ToolError(f"rev {rev!r} is not a release version: no PyPI package to pin")
    return version


def parse_config(raw: dict) -> HookConfig:
    """The hooks of a parsed `.pre-commit-config.yaml` (YAML merge keys already resolved)."""
    default_stages = tuple(raw.get("default_stages") or ("pre-commit", "pre-push", "manual"))
    hooks = []
    for repo in raw.get("repos", []):
        url = str(repo["repo"])
        name = "local" if url == "local" else url.rstrip("/").rsplit("/", 1)[-1]
        rev = str(repo.get("rev", ""))
        for h in repo.get("hooks", []):
            hooks.append(_hook(name, rev, h, default_stages))
    return HookConfig(hooks=tuple(hooks), exclude=raw.get("exclude") or "^$")


def _hook(repo: str, rev: str, h: dict, default_stages: tuple[str, ...]) -> Hook:
    hook_id = str(h.get("alias") or h["id"])
    fields: dict = {}
    known = {} if repo == "local" else REMOTE_HOOKS.get(str(h["id"]), {})
    for key in ("files", "exclude"):
        if key in h or key in known:
            fields[key] = str(h.get(key, known.get(key)))
    for key in ("types", "types_or", "exclude_types"):
        if key in h or key in known:
            fields[key] = tuple(h.get(key, known.get(key)))
    args = [str(a) for a in h.get("args", [])]
    deps = tuple(str(d) for d in h.get("additional_dependencies", []))
    if repo == "local":
        kind = "local"
        argv = tuple(shlex.split(str(h["entry"]))) + tuple(args)
        language = str(h.get("language", ""))
        requirements = deps if language == "python" else ()
    elif "kind" in known:
        kind = known["kind"]
        argv = tuple(shlex.split(known["entry"])) + tuple(args)
        language = "python"
        requirements = (f"{known['package']}=={rev_version(rev)}", *deps)
    else:
        kind, argv, language, requirements = "", (), str(h.get("language", "")), ()
    return Hook(id=hook_id, repo=repo, rev=rev, kind=kind, argv=argv, language=language,
                pass_filenames=bool(h.get("pass_filenames", True)),
                always_run=bool(h.get("always_run", False)),
                stages=tuple(h.get("stages") or default_stages),
                requirements=requirements, **fields)


def load_yaml(text: str, yaml_python: Path | None = None) -> dict:
    """Parse YAML with PyYAML: this Python's, else `yaml_python`'s (a venv that has it)."""
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        if yaml_python is None:
            raise ToolError("reading .pre-commit-config.yaml needs PyYAML") from None
        out = subprocess.run(
            [str(yaml_python), "-c",
             "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin.read())))"],
            input=text, capture_output=True, text=True, check=True).stdout
        return json.loads(out)
    return yaml.safe_load(text)
