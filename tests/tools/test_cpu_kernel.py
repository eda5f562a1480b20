"""The CPU wheel's compiled member: tools/forktool/cpu_kernel.py builds gather_rotate.c with
the build machine's compiler (issue 59: nothing is compiled on the serving machine)."""

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from forktool import cpu_kernel
from forktool.paths import Paths

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "vllm" / cpu_kernel.SOURCE


@pytest.fixture(scope="module")
def members():
    return cpu_kernel.members(Paths(repo=REPO, cache=REPO / ".cache"))


def test_members_are_the_libraries_and_their_digests(members, tmp_path):
    names = {
        f"{cpu_kernel.TARGET_DIR}/{n}"
        for n in (*cpu_kernel.LIBRARIES, cpu_kernel.DIGESTS)
    }
    assert set(members) == names
    digests = json.loads(members[f"{cpu_kernel.TARGET_DIR}/{cpu_kernel.DIGESTS}"])
    for name in cpu_kernel.LIBRARIES:
        data = members[f"{cpu_kernel.TARGET_DIR}/{name}"]
        assert digests[name] == hashlib.sha256(data).hexdigest()
        (tmp_path / name).write_bytes(data)
        symbols = subprocess.run(
            ["nm", "-D", "--defined-only", str(tmp_path / name)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for entry in (
            "gather_rotate_bf16",
            "gather_rotate_f16",
            "gather_rotate_f32",
            "gather_rotate_abi",
            "gather_rotate_isa",
            "gather_rotate_use_isa",
        ):
            assert f" {entry}\n" in symbols, (name, entry)
        dynamic = subprocess.run(
            ["readelf", "-d", str(tmp_path / name)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        # NOTE: the threaded library binds torch's OpenMP runtime at load (gather_rotate.py).
        assert "libgomp" not in dynamic, name


def test_no_machine_specific_flags():
    flags = " ".join(
        (
            *cpu_kernel.COMPILE,
            *cpu_kernel.LINK,
            *(f for extra in cpu_kernel.LIBRARIES.values() for f in extra),
        )
    )
    assert "-march" not in flags and "-mtune" not in flags and "native" not in flags
    assert "-ffp-contract=off" in cpu_kernel.COMPILE


def test_the_source_builds_where_the_compiler_has_no_fp16_type():
    """Issue 59: `_Float16` made the whole file fail on GCC 11 (bf16 entry included). GCC 12
    refuses the type without SSE2 the same way ('_Float16 is not supported on this target');
    the fp16 casts are integer code now."""
    cc = shutil.which("gcc")
    assert cc, "no gcc"
    done = subprocess.run(
        [
            cc,
            "-fsyntax-only",
            "-mno-sse2",
            "-Wall",
            "-Werror",
            "-Wno-unknown-pragmas",
            str(SOURCE),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    for old_gcc in ("gcc-11", "gcc-10"):
        if shutil.which(old_gcc):
            done = subprocess.run(
                [
                    old_gcc,
                    "-fsyntax-only",
                    *cpu_kernel.COMPILE,
                    "-fopenmp",
                    str(SOURCE),
                ],
                capture_output=True,
                text=True,
            )
            assert done.returncode == 0, (old_gcc, done.stderr)
