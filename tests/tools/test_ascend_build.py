"""`./fork build --device npu` (tools/forktool/ascend_build.py): the patched
vllm-ascend sdist and vLLM's empty-target wheel, built into a scratch cache from the
pinned sdists (no network: they are in .cache/downloads after `./fork setup`).

Oracles independent of the tool: GNU `patch` applies the series to the upstream files
(the tool uses `git apply`), the upstream sdists are read member by member, the overlay
files are the repository's bytes. The two wheels' requirements, resolved transitively,
provide every third-party module the overlay imports. Then the artifacts are installed
with pip into a folder and imported, beside only the distributions those requirements
resolve to, under vllm-ascend's own mock `torch_npu` (its tests/ut/conftest.py, which
`./fork upstream-tests --ascend` runs under). Nothing here builds vllm-ascend's kernels
or runs NPU code: no CANN and no NPU on this machine.
"""

from __future__ import annotations

import ast
import base64
import csv
import email
import hashlib
import importlib.metadata as md
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from forktool import ascend_build, bases
from forktool.paths import Paths
from forktool.progress import ToolError
from forktool.releases import release
from forktool.tree import overlay_files
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.connector"


@dataclass(frozen=True)
class Built:
    paths: Paths
    files: list[Path]
    seconds: float


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    real = Paths.default("0.23")
    if not real.venv_python().exists():
        pytest.fail(f"{real.venv_python()} is missing: run `./fork setup` first")
    cache = tmp_path_factory.mktemp("npu-cache")
    # The pinned downloads and the venv are shared; .cache/dist/npu and .cache/npu are
    # not.
    (cache / "downloads").symlink_to(real.downloads)
    (cache / "venv").symlink_to(real.venv)
    paths = Paths(repo=real.repo, cache=cache, base=real.base)
    t0 = time.monotonic()
    files = ascend_build.build(paths)
    return Built(paths, files, time.monotonic() - t0)


def _series(paths: Paths, tree: str) -> list[Path]:
    d = paths.patches_dir(tree)
    names = [
        ln.split("#", 1)[0].strip() for ln in (d / "series").read_text().splitlines()
    ]
    return [d / n for n in names if n]


def _gnu_patched(
    paths: Paths, tree: str, upstream: dict[str, bytes], tmp: Path
) -> dict[str, bytes]:
    """Every file the series touches, patched by GNU patch (no fuzz), from
    `upstream`."""
    root = tmp / f"gnu-{tree}"
    root.mkdir()
    touched = set()
    for p in _series(paths, tree):
        for line in p.read_text().splitlines():
            if line.startswith("diff --git a/"):
                touched.add(line.split(" b/", 1)[1])
    for rel in touched:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(upstream[rel])
    for p in _series(paths, tree):
        subprocess.run(
            ["patch", "-p1", "-F0", "-s", "--no-backup-if-mismatch", "-i", str(p)],
            cwd=root,
            check=True,
        )
    return {rel: (root / rel).read_bytes() for rel in touched}


def _sdist_members(path: Path) -> dict[str, tuple[str, tarfile.TarInfo, bytes | None]]:
    """Member path below the top folder -> (top folder, member, content of a file)."""
    out = {}
    with tarfile.open(path) as tar:
        for m in tar:
            top, _, rel = m.name.partition("/")
            out[rel] = (top, m, tar.extractfile(m).read() if m.isfile() else None)
    return out


def _clean_env() -> dict[str, str]:
    drop = ("PYTHONPATH", "VLLM_VERSION")
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.fixture(scope="module")
def ascend_wheel(built: Built, tmp_path_factory) -> Path:
    """The wheel vllm-ascend's own setup.py builds from the patched sdist, without its
    kernels (COMPILE_CUSTOM_KERNELS=0: they need CANN)."""
    out = tmp_path_factory.mktemp("ascend-wheel")
    subprocess.run(
        [
            str(built.paths.venv_python()),
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out),
            str(built.files[0]),
        ],
        check=True,
        env={
            **_clean_env(),
            "SOC_VERSION": "ascend910b1",
            "COMPILE_CUSTOM_KERNELS": "0",
        },
    )
    (whl,) = out.glob("*.whl")
    assert whl.name == "vllm_ascend-0.23.0.post1+chunkcache-py3-none-any.whl"
    return whl


def _requires(whl: Path) -> list[str]:
    """A wheel's Requires-Dist, as pip reads them."""
    with zipfile.ZipFile(whl) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(meta)).get_all("Requires-Dist") or []


def _resolved(requirements: list[str]) -> dict[str, md.Distribution | None]:
    """Every distribution `requirements` bring, transitively, markers evaluated for this
    machine and the extras asked for: name -> the installed distribution whose metadata
    was read (None: not installed here, e.g. torch-npu; a leaf). Versions are not
    compared: the question is which distributions a user's pip installs."""
    out: dict[str, md.Distribution | None] = {}
    todo = [(Requirement(r), "") for r in requirements]
    done = set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in done:
            continue
        done.add((name, frozenset(req.extras)))
        try:
            dist: md.Distribution | None = md.distribution(name)
        except md.PackageNotFoundError:
            dist = None
        out.setdefault(name, dist)
        for text in dist.requires or [] if dist is not None else []:
            sub = Requirement(text)
            for e in ["", *req.extras]:
                if sub.marker is None or sub.marker.evaluate({"extra": e}):
                    todo.append((sub, e))
                    break
    # The two artifacts themselves are installed from their wheels.
    return {n: d for n, d in out.items() if n not in ("vllm", "vllm-ascend")}


def _only(resolved: dict[str, md.Distribution | None], folder: Path) -> Path:
    """A folder of links to the installed files of the `resolved` distributions (their
    top-level packages, modules and dist-info folders) and nothing else."""
    folder.mkdir()
    for dist in resolved.values():
        if dist is None:
            continue
        for f in dist.files or []:
            top = f.parts[0]
            if top == ".." or top.endswith(".pth") or (folder / top).exists():
                continue
            src = Path(str(dist.locate_file(top)))
            if src.exists():
                (folder / top).symlink_to(src)
    return folder


def _third_party_imports(paths: Paths) -> dict[str, list[str]]:
    """Top-level module -> the overlay files that import it, for every import of a
    module neither the standard library's nor vLLM's nor vllm-ascend's, but those the
    overlay guards itself (in a `try` that catches ImportError: mooncake, triton) and
    those for type checkers only (`if TYPE_CHECKING`)."""
    out: dict[str, list[str]] = {}
    own = {"vllm", "vllm_ascend", "__future__"}

    def visit(nodes: list[ast.stmt], rel: str) -> None:
        for node in nodes:
            if isinstance(node, ast.Try):
                caught = " ".join(ast.unparse(h.type) for h in node.handlers if h.type)
                if "ImportError" not in caught and "ModuleNotFoundError" not in caught:
                    visit(node.body, rel)
                for h in node.handlers:
                    visit(h.body, rel)
                visit(node.orelse + node.finalbody, rel)
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse, rel)
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                names = []
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []), rel)
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in own:
                    out.setdefault(top, []).append(rel)

    for tree in ("vllm", "vllm-ascend"):
        for rel, f in overlay_files(paths, tree).items():
            if rel.endswith(".py"):
                visit(ast.parse(f.read_bytes()).body, rel)
    return out


def test_every_module_the_overlay_imports_comes_with_the_wheels_requirements(
    built: Built, ascend_wheel: Path
):
    """What `pip install` of the two artifacts installs (their requirements, resolved
    transitively through the metadata of the distributions installed here) provides
    every third-party module the overlay imports: neither vLLM nor vllm-ascend requires
    xxhash, so the vLLM wheel must."""
    resolved = _resolved(_requires(built.files[1]) + _requires(ascend_wheel))
    providers = md.packages_distributions()
    imports = _third_party_imports(built.paths)
    assert {"torch", "numpy", "xxhash"} <= set(imports)
    missing = {
        module: files
        for module, files in imports.items()
        # A distribution not installed here provides the module of its own name
        # (torch-npu: torch_npu).
        if not {canonicalize_name(d) for d in providers.get(module, [module])}
        & set(resolved)
    }
    assert not missing, f"imported by the overlay, required by neither wheel: {missing}"


def test_the_artifacts_are_named_by_their_own_versions(built: Built):
    names = [p.name for p in built.files]
    assert names == [
        "vllm_ascend-0.23.0.post1+chunkcache.tar.gz",
        "vllm-0.23.0+chunkcache.empty-py3-none-any.whl",
    ]
    assert all(p.parent == built.paths.dist / "npu" for p in built.files)
    # Never the workflow's trees (other work uses them).
    assert not built.paths.trees.exists()
    print(
        f"build: {built.seconds:.0f} s; "
        + ", ".join(f"{p.name} {p.stat().st_size / 1e6:.1f} MB" for p in built.files)
    )


def test_the_ascend_sdist_is_upstream_plus_the_series_and_the_overlay(
    built: Built, tmp_path: Path
):
    paths = built.paths
    up = _sdist_members(bases.base_for(paths, "vllm-ascend", "sdist").path)
    ours = _sdist_members(built.files[0])
    top = "vllm_ascend-0.23.0.post1+chunkcache"
    assert {t for t, _, _ in ours.values()} == {top}
    expected = _gnu_patched(
        paths,
        "vllm-ascend",
        {rel: d for rel, (_, _, d) in up.items() if d is not None},
        tmp_path,
    )
    overlay = {
        rel: f.read_bytes() for rel, f in overlay_files(paths, "vllm-ascend").items()
    }
    assert overlay and not set(overlay) & set(up)
    assert set(ours) == set(up) | set(overlay)
    for rel, (_, m, data) in ours.items():
        if rel in overlay:
            assert data == overlay[rel], rel
            continue
        _, um, udata = up[rel]
        assert (m.mode, m.type) == (um.mode, um.type), rel
        if rel in expected:
            assert data == expected[rel] != udata, rel
        elif rel in ("PKG-INFO", "vllm_ascend.egg-info/PKG-INFO"):
            assert data == udata.replace(
                b"\nVersion: 0.23.0.post1\n", b"\nVersion: 0.23.0.post1+chunkcache\n"
            ), rel
            assert data != udata
        elif rel == "vllm_ascend.egg-info/SOURCES.txt":
            assert set(data.decode().split()) == set(udata.decode().split()) | set(
                overlay
            )
        else:
            assert data == udata, rel


def test_the_vllm_wheel_is_the_patched_sdist_as_pure_python(
    built: Built, tmp_path: Path
):
    paths = built.paths
    up = {
        rel: d
        for rel, (_, _, d) in _sdist_members(
            bases.base_for(paths, "vllm", "sdist").path
        ).items()
        if d is not None
    }
    expected = _gnu_patched(paths, "vllm", up, tmp_path)
    overlay = {rel: f.read_bytes() for rel, f in overlay_files(paths, "vllm").items()}
    info = "vllm-0.23.0+chunkcache.empty.dist-info"
    with zipfile.ZipFile(built.files[1]) as whl:
        members = {n: whl.read(n) for n in whl.namelist()}
    package = {n: d for n, d in members.items() if not n.startswith(info + "/")}
    assert not [n for n in members if n.endswith((".so", "/vllm-rs"))]
    # Every Python file of the upstream package (the series' version where it patches
    # one) and every overlay file, byte for byte; vllm/_version.py is generated by the
    # build.
    py = {rel for rel in up if rel.startswith("vllm/") and rel.endswith(".py")}
    assert py - set(package) == {rel for rel in py if expected.get(rel, b"") is None}
    for rel in py | set(overlay):
        if rel == "vllm/_version.py":
            continue
        want = overlay.get(rel, expected.get(rel, up.get(rel)))
        assert package[rel] == want, rel
    assert [
        rel for rel in expected if rel.startswith("vllm/") and expected[rel] != up[rel]
    ]
    for rel, data in package.items():  # data files too: upstream's bytes
        if rel in up and rel not in expected and rel != "vllm/_version.py":
            assert data == up[rel], rel
    assert "__version__ = version = '0.23.0'\n" in package["vllm/_version.py"].decode()
    metadata = members[f"{info}/METADATA"].decode()
    assert "\nVersion: 0.23.0+chunkcache.empty\n" in metadata
    # The overlay imports xxhash; vLLM's requirements (common.txt) do not name it.
    assert "\nRequires-Dist: xxhash\n" in metadata
    wheel = members[f"{info}/WHEEL"].decode()
    assert "Root-Is-Purelib: true" in wheel
    assert [ln for ln in wheel.splitlines() if ln.startswith("Tag:")] == [
        "Tag: py3-none-any"
    ]
    # RECORD lists every member with its hash.
    rows = list(csv.reader(io.StringIO(members[f"{info}/RECORD"].decode())))
    assert {r[0] for r in rows} == set(members)
    for name, digest, size in rows:
        if name == f"{info}/RECORD":
            continue
        h = base64.urlsafe_b64encode(hashlib.sha256(members[name]).digest()).rstrip(
            b"="
        )
        assert (digest, size) == (f"sha256={h.decode()}", str(len(members[name]))), name


def test_both_install_with_pip_and_import_under_vllm_ascends_mock_torch_npu(
    built: Built, ascend_wheel: Path, tmp_path: Path
):
    """What the user's pip makes of the artifacts: vllm-ascend's own setup.py builds
    the patched sdist (COMPILE_CUSTOM_KERNELS=0: its kernels need CANN), pip installs
    both wheels into a folder, and a fresh interpreter imports vLLM, vllm-ascend and the
    fork's Ascend modules from there, under vllm-ascend's mock torch_npu, with only the
    distributions the two wheels' requirements resolve to beside them (_resolved)."""
    py = str(built.paths.venv_python())
    env = _clean_env()
    t0 = time.monotonic()
    target = tmp_path / "site"
    subprocess.run(
        [
            py,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--no-compile",
            "--disable-pip-version-check",
            "-q",
            "--target",
            str(target),
            str(ascend_wheel),
            str(built.files[1]),
        ],
        check=True,
        env=env,
    )
    installed = time.monotonic() - t0
    # NOTE: the dependencies as pip resolves them from the two wheels' requirements,
    # from the distributions this machine has (no index in this tier), and nothing
    # else: not the fork's venv, whose requirements/dev.txt brings more (xxhash, for
    # one). pytest is the mock's (vllm-ascend's tests/ut/conftest.py imports it).
    wanted = _requires(built.files[1]) + _requires(ascend_wheel) + ["pytest"]
    deps = _only(_resolved(wanted), tmp_path / "deps")
    with tarfile.open(built.files[0]) as tar:
        top = tar.getnames()[0].split("/")[0]
        tar.extract(f"{top}/tests/ut/conftest.py", tmp_path, filter="data")
    conftest = tmp_path / top / "tests" / "ut" / "conftest.py"
    overlay = overlay_files(built.paths, "vllm-ascend")
    patched = sorted(
        {
            line.split(" b/", 1)[1]
            for p in _series(built.paths, "vllm-ascend")
            for line in p.read_text().splitlines()
            if line.startswith("diff --git a/")
        }
    )
    modules = {_module(rel): rel for rel in [*overlay, *patched] if rel.endswith(".py")}
    t1 = time.monotonic()
    proc = subprocess.run(
        # -S: no site-packages of the venv; the standard library and PYTHONPATH only.
        [
            py,
            "-S",
            str(HERE / "ascend_import_check.py"),
            str(conftest),
            *modules,
            CONNECTOR,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "PYTHONPATH": f"{target}{os.pathsep}{deps}"},
    )
    imported = time.monotonic() - t1
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    report = json.loads(line[len("REPORT ") :])

    assert report["torch_npu_is_the_mock"]
    assert report["vllm_file"] == str(target / "vllm" / "__init__.py")
    assert report["vllm_ascend_file"] == str(target / "vllm_ascend" / "__init__.py")
    assert report["vllm_dist_version"] == "0.23.0+chunkcache.empty"
    assert report["vllm_ascend_dist_version"] == "0.23.0.post1+chunkcache"
    # vllm-ascend chooses its vLLM 0.23.0 code paths by
    # Version(vllm.__version__) == 0.23.0.
    assert report["vllm_version_attr"] == "0.23.0"
    assert report["vllm_version_is_0_23_0"] is True
    assert "ascend_kv_connector" in report["vllm_ascend_general_plugins"]
    with tarfile.open(built.files[0]) as tar:
        in_sdist = {
            rel: tar.extractfile(f"{top}/{rel}").read() for rel in modules.values()
        }
    # The connector `--enable-chunk-cache` loads (it imports xxhash), from vLLM's wheel.
    assert report["modules"][CONNECTOR]["file"] == str(
        target / (CONNECTOR.replace(".", "/") + ".py")
    )
    for name, rel in modules.items():
        got = report["modules"][name]
        assert got["file"] == str(target / rel), name
        assert got["text"].encode() == in_sdist[rel], name
        if rel in overlay:
            assert got["text"].encode() == overlay[rel].read_bytes(), name
    assert report["registered"]["cache_writers_file"].startswith(
        str(target / "vllm") + "/"
    )
    assert report["registered"]["standard_attention_writer_is_the_overlay's"]
    assert report["registered"]["mla_writer_is_the_overlay's"]
    print(
        f"vllm_ascend wheel build + pip install: {installed:.0f} s; import check: "
        f"{imported:.0f} s; modules: {sorted(modules)}"
    )


def _module(rel: str) -> str:
    name = rel.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def test_a_second_build_with_the_same_inputs_reuses_the_artifacts(built: Built):
    # NOTE: a build first: the repository is shared with other work while this module
    # runs, and a changed overlay file or patch rightly rebuilds.
    first = ascend_build.build(built.paths)
    before = [(p.stat().st_mtime_ns, p.stat().st_size) for p in first]
    t0 = time.monotonic()
    again = ascend_build.build(built.paths)
    assert again == first == built.files
    assert [(p.stat().st_mtime_ns, p.stat().st_size) for p in again] == before
    assert time.monotonic() - t0 < 30


def test_only_the_release_vllm_ascend_pins_builds(tmp_path: Path):
    paths = Paths(repo=Paths.default().repo, cache=tmp_path, base=release("0.32"))
    with pytest.raises(ToolError, match=r"--base 0.23"):
        ascend_build.build(paths)


def _fake_empty_wheel(
    path: Path, version_py: str, extra: dict[str, bytes] | None = None
) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr("vllm/_version.py", version_py)
        z.writestr(
            "vllm-0.23.0+empty.dist-info/METADATA",
            "Name: vllm\nVersion: 0.23.0+empty\n",
        )
        z.writestr(
            "vllm-0.23.0+empty.dist-info/WHEEL",
            "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
            "Tag: cp311-cp311-linux_x86_64\n",
        )
        z.writestr("vllm-0.23.0+empty.dist-info/RECORD", "")
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    return path


def test_a_labelled_vllm_version_or_a_compiled_file_is_refused(tmp_path: Path):
    """What VLLM_VERSION_OVERRIDE would make (vllm/_version.py with the label, so
    vllm-ascend takes its not-0.23.0 branches) and a wheel with a native library are
    refused by name; upstream's own empty build is relabelled."""
    good = _fake_empty_wheel(
        tmp_path / "good.whl", "__version__ = version = '0.23.0'\n"
    )
    out = ascend_build.relabel_wheel(
        good, tmp_path / "out.whl", "0.23.0", "0.23.0+chunkcache.empty"
    )
    with zipfile.ZipFile(out) as z:
        assert (
            "Version: 0.23.0+chunkcache.empty"
            in z.read("vllm-0.23.0+chunkcache.empty.dist-info/METADATA").decode()
        )
    labelled = _fake_empty_wheel(
        tmp_path / "l.whl", "__version__ = version = '0.23.0+chunkcache.empty'\n"
    )
    with pytest.raises(ToolError, match=r"_version.py .* does not say"):
        ascend_build.relabel_wheel(labelled, tmp_path / "x.whl", "0.23.0", "0.23.0+x")
    native = _fake_empty_wheel(
        tmp_path / "n.whl",
        "__version__ = version = '0.23.0'\n",
        {"vllm/_C.abi3.so": b"\x7fELF"},
    )
    with pytest.raises(ToolError, match=r"compiled files \['vllm/_C.abi3.so'\]"):
        ascend_build.relabel_wheel(native, tmp_path / "y.whl", "0.23.0", "0.23.0+x")
