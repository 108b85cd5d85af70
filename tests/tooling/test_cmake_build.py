"""CMakeLists.txt with PE_WITH_CUDA=ON links the CUDA runtime shared: one runtime beside torch's.

CMake links CUDA targets against the static cudart (plus cudadevrt) unless told otherwise; a
module with its own static runtime keeps its own runtime state next to the libcudart.so that
torch loaded. Configuring is enough to see the link line, and works on CPU machines with nvcc
(the CUDA half talks to the runtime only; see docs/building.md).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = Path(home) / "bin" / "nvcc"
    return shutil.which("nvcc") or (str(candidate) if candidate.exists() else None)


@pytest.mark.slow  # ~10 s: a CMake configure with CUDA
def test_cmake_cuda_build_links_the_shared_cuda_runtime(tmp_path: Path) -> None:
    nvcc = _nvcc()
    for tool, path in (("cmake", shutil.which("cmake")), ("ninja", shutil.which("ninja")), ("nvcc", nvcc)):
        if path is None:
            pytest.skip(f"{tool} not found (needed to configure the CMake CUDA build)")
    proc = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(tmp_path), "-G", "Ninja", "-DPE_WITH_CUDA=ON",
         f"-DCMAKE_CUDA_COMPILER={nvcc}"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TORCH_CUDA_ARCH_LIST="9.0"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ninja = (tmp_path / "build.ninja").read_text()
    link = [line for line in ninja.splitlines() if line.strip().startswith("LINK_LIBRARIES")]
    assert len(link) == 1, link  # the one target, _C
    libs = link[0]
    assert "cudart_static" not in libs, f"static CUDA runtime on the link line: {libs}"
    assert re.search(r"libcudart\.so|-lcudart\b", libs), f"no shared CUDA runtime: {libs}"


@pytest.mark.slow  # ~10 s: a CMake configure
def test_cmake_build_compiles_against_torchs_pybind11(tmp_path: Path) -> None:
    """engine._C must see the pybind11 headers torch bundles (its casters and exception
    translation were built with them), not the pip pybind11 whose CMake helpers build the
    module: pybind11_add_module put pip's first, and pip's 3.1 (internals v12) is another ABI
    than torch's 3.0 (v11). Issue 22 asked to rule such mismatches out."""
    import json

    import torch

    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        pytest.skip("cmake and ninja are needed to configure the CMake build")
    proc = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(tmp_path), "-G", "Ninja",
         "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    commands = json.loads((tmp_path / "compile_commands.json").read_text())
    argv = next(c["command"] for c in commands if c["file"].endswith("bindings.cpp")).split()
    # the compiler's search order: every -I directory, then every -isystem one
    dirs = [a[2:] for a in argv if a.startswith("-I") and len(a) > 2]
    dirs += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-I"]
    dirs += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-isystem"]
    with_pybind11 = [d for d in dirs if (Path(d) / "pybind11" / "pybind11.h").exists()]
    torch_include = Path(torch.__file__).parent / "include"
    assert with_pybind11 and Path(with_pybind11[0]).resolve() == torch_include.resolve(), dirs
