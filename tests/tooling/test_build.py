"""Build checks for engine._C: what it says about itself, and that the CUDA half compiles.

The CUDA sources cannot be exercised without a GPU, but they can be compiled: the .cu
files include no torch header (the CPU torch wheel has no CUDA headers), so a bare
``nvcc -c -arch=sm_90`` on a CPU machine catches their compile errors in CI.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CU_SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def test_build_info_has_the_documented_keys_and_types() -> None:
    from engine import _C

    info = _C.build_info()
    assert set(info) >= {"cuda", "cuda_archs", "cuda_version", "torch_version", "compiler"}
    assert isinstance(info["cuda"], bool)
    assert isinstance(info["cuda_archs"], list)
    assert all(re.fullmatch(r"sm_\d+[af]?", a) for a in info["cuda_archs"]), info["cuda_archs"]
    assert isinstance(info["compiler"], str) and info["compiler"]
    # built against the torch it runs with (same major.minor: the C++ ABI is per release)
    built = info["torch_version"].split("+")[0].split(".")[:2]
    assert built == torch.__version__.split("+")[0].split(".")[:2]
    if info["cuda"]:
        assert info["cuda_archs"], "a CUDA build must record its archs"
        assert re.fullmatch(r"\d+\.\d+", info["cuda_version"])
        assert "nvcc" in info["compiler"]
    else:
        assert info["cuda_archs"] == [] and info["cuda_version"] is None


def test_info_command_reports_the_extension() -> None:
    from engine import _C
    from engine.cli import info

    facts = info.collect()
    assert facts["extension"] == "built"
    assert facts["extension_cuda"] == _C.build_info()["cuda"]
    assert facts["extension_libstdcxx"] == "shared"


def test_the_extension_uses_the_process_libstdcxx() -> None:
    """engine._C names libstdc++.so among its NEEDED libraries: the CUDA build on the H100
    machine linked it statically and crashed (SIGSEGV) formatting its first error message
    (issue 22, 2026-11-26: its CXX=/opt/gcc/bin/g++ links libstdc++ statically); setup.py
    now picks a compiler that links it shared and checks the module it built."""
    from engine import _C
    from engine.tooling.cxx_runtime import needed_libraries

    needed = needed_libraries(_C.__file__)
    assert any(n.startswith("libstdc++.so") for n in needed), needed


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("static", [False, True], ids=["shared", "static"])
def test_the_needed_reader_tells_a_static_libstdcxx(static: bool, tmp_path: Path) -> None:
    """The check above can fail: a library built with -static-libstdc++ names no libstdc++,
    and engine info says so, with the fix."""
    from engine.tooling.cxx_runtime import needed_libraries
    from engine.cli.info import libstdcxx_linkage

    src = tmp_path / "x.cpp"
    src.write_text('#include <sstream>\n#include <string>\n'
                   'std::string f(long v) { std::ostringstream s; s << v; return s.str(); }\n')
    lib = tmp_path / "libx.so"
    flags = ["-static-libstdc++"] if static else []
    subprocess.run(["g++", "-shared", "-fPIC", *flags, str(src), "-o", str(lib)], check=True)
    needed = needed_libraries(lib)
    assert any(n.startswith("libstdc++.so") for n in needed) is not static
    report = libstdcxx_linkage(str(lib))
    assert report == "shared" if not static else report.startswith("STATIC") and "CXX=" in report


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf")
def test_the_needed_reader_agrees_with_readelf() -> None:
    """The module's own ELF reader (kept because readelf and pyelftools are not guaranteed
    where it runs: docs/DESIGN.md) reads what binutils reads, on the extension and on
    libraries of the system and of torch."""
    import re

    import torch

    from engine import _C
    from engine.tooling.cxx_runtime import needed_libraries

    torch_lib = Path(torch.__file__).parent / "lib"
    files = [Path(_C.__file__), *sorted(torch_lib.glob("libc10.so"))]
    for f in files:
        out = subprocess.run(["readelf", "-d", "-W", str(f)], capture_output=True, text=True,
                             check=True).stdout
        assert needed_libraries(f) == re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out), f


def test_the_needed_reader_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    from engine.tooling.cxx_runtime import needed_libraries

    bad = tmp_path / "not-elf.so"
    bad.write_bytes(b"hello, world" * 10)
    with pytest.raises(ValueError, match="not-elf.so: not an ELF file"):
        needed_libraries(bad)


def test_installed_version_names_the_build() -> None:
    """The local version tag says which torch/CUDA/archs this build is for (docs/building.md)."""
    from engine import _C

    try:
        version = importlib.metadata.version("pipeline-engine")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pipeline-engine is not installed (running from a bare source tree)")
    if "+" not in version:
        pytest.skip(f"built without a local version tag ({version}; PE_VERSION_TAG='')")
    local = version.split("+", 1)[1]
    info = _C.build_info()
    torch_mm = ".".join(info["torch_version"].split("+")[0].split(".")[:2])
    assert re.search(rf"(^|\.)torch{re.escape(torch_mm)}(\.|$)", local), local
    stale = (
        f"installed metadata says {version} but engine._C reports {info}: the metadata is "
        "from another build (e.g. a wheel built in this tree); reinstall with "
        "`pip install --no-build-isolation -e .`"
    )
    if info["cuda"]:
        assert local.startswith("cu"), stale
        for arch in info["cuda_archs"]:
            assert arch.replace("_", "") in local.split("."), stale
    else:
        assert local.startswith("cpu"), stale


def test_cpu_sources_never_need_cuda_headers() -> None:
    """The CPU build compiles csrc/*.cpp without CUDA headers: CUDA includes stay guarded."""
    for src in sorted((ROOT / "csrc").glob("*.cpp")) + sorted((ROOT / "csrc").glob("*.h")):
        depth = 0
        guarded = 0
        for line in src.read_text().splitlines():
            s = line.strip()
            if s.startswith("#if"):
                depth += 1
                if "PE_WITH_CUDA" in s:
                    guarded = depth
            elif s.startswith("#endif"):
                if guarded == depth:
                    guarded = 0
                depth -= 1
            elif s.startswith("#include"):
                needs_cuda = re.search(r"cuda|c10/cuda|ATen/cuda", s) is not None
                if needs_cuda:
                    assert guarded, f"{src.name}: unguarded CUDA include {s!r}"


def test_cuda_sources_include_no_torch_headers() -> None:
    assert CU_SOURCES, "csrc/cuda/*.cu missing"
    for src in CU_SOURCES + sorted((ROOT / "csrc" / "cuda").glob("*.h")):
        for line in src.read_text().splitlines():
            if line.strip().startswith("#include"):
                assert not re.search(r"torch|ATen|c10", line), f"{src.name}: {line.strip()}"


@pytest.mark.parametrize("source", CU_SOURCES, ids=lambda p: p.name)
def test_cuda_sources_compile_standalone_for_sm90(source: Path, tmp_path: Path) -> None:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    out = tmp_path / (source.stem + ".o")
    proc = subprocess.run(
        [nvcc, "-c", "-arch=sm_90", "-O2", "-std=c++17", str(source), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out.stat().st_size > 0


def _static_wrapper(tmp_path: Path) -> str:
    """A C++ compiler command like the H100 machine's /opt/gcc/bin/g++: libstdc++ static."""
    wrapper = tmp_path / "static-g++"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_setup_picks_a_compiler_that_links_libstdcxx_shared(tmp_path: Path) -> None:
    """pick_compilers (what setup.py runs before building): the compiler a build would use
    is kept when it links libstdc++ shared, and replaced (CXX and CC, with a note) by one
    that does when it links it statically; a static-only machine gets an error with the fix."""
    from engine.tooling import cxx_runtime as cr

    static = _static_wrapper(tmp_path)
    assert cr.compiler_links_shared("g++") is True
    assert cr.compiler_links_shared(static) is False
    assert cr.compiler_links_shared(str(tmp_path / "no-such-g++")) is None
    assert cr.pick_compilers({"CXX": "g++"}) == ({}, "")
    env, note = cr.pick_compilers({"CXX": static})
    assert cr.compiler_links_shared(env["CXX"]) is True and static not in env.values()
    assert env.get("CC", "").endswith(("gcc", "cc", "clang"))
    assert static in note and "statically" in note


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_machine_with_only_a_static_libstdcxx_compiler_gets_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.tooling import cxx_runtime as cr

    static = _static_wrapper(tmp_path)
    monkeypatch.setattr(cr, "compiler_links_shared", lambda cxx: False)  # every compiler static
    with pytest.raises(RuntimeError, match=r"links libstdc\+\+ statically.*CXX=/usr/bin/g\+\+"):
        cr.pick_compilers({"CXX": static})


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_post_build_check_fails_a_static_module(tmp_path: Path) -> None:
    """``python engine/tooling/cxx_runtime.py FILE`` (CMakeLists.txt's post-build step): 1 with the
    fix for a module with libstdc++ inside, 0 for the installed engine._C."""
    from engine import _C

    src = tmp_path / "x.cpp"
    src.write_text("#include <string>\nstd::string f() { return std::string(40, 'x'); }\n")
    lib = tmp_path / "libx.so"
    subprocess.run([_static_wrapper(tmp_path), "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    script = Path(__file__).resolve().parents[2] / "engine" / "tooling" / "cxx_runtime.py"
    bad = subprocess.run([sys.executable, str(script), str(lib)], capture_output=True, text=True)
    assert bad.returncode == 1 and "statically" in bad.stderr and "CXX=" in bad.stderr
    good = subprocess.run([sys.executable, str(script), _C.__file__], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_pick_command_says_which_compiler_a_build_uses(tmp_path: Path) -> None:
    """``python engine/tooling/cxx_runtime.py --pick`` (.ci/gpu's build phase prints it, since pip
    hides setup.py's own note): kept, switched with the reason, or refused with the fix."""
    script = ROOT / "engine" / "tooling" / "cxx_runtime.py"

    def pick(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), "--pick"], capture_output=True,
                              text=True, env={**os.environ, **env}, timeout=300)

    kept = pick(CXX="g++")
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.strip() == ("no compiler switch: g++ links libstdc++ shared; "
                                   "the build uses it")
    static = _static_wrapper(tmp_path)
    switched = pick(CXX=static)
    assert switched.returncode == 0, switched.stderr
    assert switched.stdout.startswith(f"compiler switch: {static} links libstdc++ statically")
    assert "CXX=" in switched.stdout and f"CXX={static}" not in switched.stdout
