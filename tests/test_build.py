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
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
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
    from engine import _C, info

    facts = info.collect()
    assert facts["extension"] == "built"
    assert facts["extension_cuda"] == _C.build_info()["cuda"]


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
