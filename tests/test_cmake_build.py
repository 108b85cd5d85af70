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

ROOT = Path(__file__).resolve().parents[1]


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
