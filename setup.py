"""Build script for pipeline-engine's compiled extension, ``engine._C``.

Why a setup.py next to pyproject.toml: the extension is built with torch's own extension
machinery (``torch.utils.cpp_extension``), which needs code at build time to decide between
a C++-only build (every machine) and a C++/CUDA build (a CUDA torch plus nvcc), to pick the
GPU architectures, and to stamp what it built for into the module and the wheel's version.
Everything declarative (name, dependencies, pytest markers) stays in pyproject.toml.

Environment knobs (all optional):

* ``TORCH_CUDA_ARCH_LIST``  e.g. ``"9.0"`` or ``"8.0;9.0+PTX"``: the GPU archs to compile
  for (default: the local GPU's arch; with no GPU visible, the archs torch was built for).
* ``PE_BUILD_CUDA=0``       force the C++-only build even where CUDA is available.
* ``PE_PREBUILT_C``         path to an ``_C*.so`` built elsewhere (e.g. with CMakeLists.txt):
  package it instead of compiling; the version tag then comes from its ``build_info()``.
* ``PE_VERSION_TAG``        override the PEP 440 local version tag appended to the version
  (default ``cu130.torch2.11.sm90`` style for CUDA builds, ``cpu.torch2.13`` for CPU
  builds); set it to an empty string for a plain version.

Build with ``pip install --no-build-isolation -e .`` (the build needs the torch it will run
against, so build isolation, which would fetch another torch, must be off). See
docs/building.md for wheels per GPU arch and the CMake route.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - a build without torch cannot build the extension
    sys.exit(
        "pipeline-engine: building engine._C needs torch installed in this environment; "
        "install torch first, then run `pip install --no-build-isolation -e .`"
    )


def _torch_short() -> str:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"{major}.{minor}"


def _want_cuda() -> tuple[bool, str]:
    """CUDA build only when a CUDA torch, a CUDA toolkit and nvcc are all present."""
    if os.environ.get("PE_BUILD_CUDA", "").strip() == "0":
        return False, "PE_BUILD_CUDA=0"
    if not torch.version.cuda:
        return False, f"torch {torch.__version__} is a CPU build"
    home = cpp_extension.CUDA_HOME
    if not home:
        return False, "no CUDA toolkit found (set CUDA_HOME)"
    nvcc = Path(home) / "bin" / "nvcc"
    if not nvcc.exists() and shutil.which("nvcc") is None:
        return False, f"nvcc not found under {home}/bin or on PATH"
    return True, f"CUDA torch {torch.__version__} and toolkit at {home}"


def _parse_arch_list(spec: str) -> list[str]:
    """TORCH_CUDA_ARCH_LIST syntax ("8.0;9.0+PTX", "9.0a", "sm_90") -> ["sm_80", "sm_90"]."""
    archs: list[str] = []
    for item in re.split(r"[;,\s]+", spec.strip()):
        if not item:
            continue
        item = item.replace("+PTX", "").replace("+ptx", "")
        m = re.fullmatch(r"(?:sm_)?(\d+)\.?(\d)([af]?)", item)
        if m is None:
            sys.exit(
                f"pipeline-engine: cannot read TORCH_CUDA_ARCH_LIST entry {item!r}; "
                'use compute capabilities such as "9.0" or "8.0;9.0+PTX"'
            )
        arch = f"sm_{m.group(1)}{m.group(2)}{m.group(3)}"
        if arch not in archs:
            archs.append(arch)
    return archs


def _cuda_archs() -> list[str]:
    spec = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not spec:
        if torch.cuda.is_available():
            caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
            spec = ";".join(f"{major}.{minor}" for major, minor in sorted(caps))
        else:
            # No GPU visible (a build machine): the archs torch itself was compiled for.
            try:
                flags = torch._C._cuda_getArchFlags() or ""
            except (AttributeError, RuntimeError):
                flags = ""
            built = [a for a in flags.split() if re.fullmatch(r"sm_\d+[af]?", a)]
            if not built:
                sys.exit(
                    "pipeline-engine: no GPU visible and torch does not list its CUDA archs; "
                    "set TORCH_CUDA_ARCH_LIST (e.g. TORCH_CUDA_ARCH_LIST=9.0)"
                )
            spec = ";".join(f"{a[3:-1]}.{a[-1]}" if a[-1].isdigit() else f"{a[3:-2]}.{a[-2:]}" for a in built)
        # torch reads the same variable when it builds the nvcc flags: set it so the archs
        # we record are exactly the ones compiled.
        os.environ["TORCH_CUDA_ARCH_LIST"] = spec
    return _parse_arch_list(spec)


def _write_build_config(archs: list[str]) -> Path:
    """Generate pe_build_config.h (strings via a header: -D quoting breaks under ninja)."""
    out_dir = ROOT / "build" / "pe_generated"
    out_dir.mkdir(parents=True, exist_ok=True)
    header = out_dir / "pe_build_config.h"
    text = (
        "// Generated by setup.py; do not edit.\n"
        "#pragma once\n"
        f'#define PE_CUDA_ARCHS "{";".join(archs)}"\n'
        f'#define PE_TORCH_VERSION "{torch.__version__}"\n'
    )
    if not header.exists() or header.read_text() != text:
        header.write_text(text)
    return out_dir


def _version_tag(cuda: bool, archs: list[str], cuda_version: str | None = None) -> str:
    """PEP 440 local version: which CUDA, torch and archs a wheel was built for."""
    if "PE_VERSION_TAG" in os.environ:
        return os.environ["PE_VERSION_TAG"].strip()
    torch_part = f"torch{_torch_short()}"
    if not cuda:
        return f"cpu.{torch_part}"
    cu = "cu" + str(cuda_version or torch.version.cuda or "").replace(".", "")
    arch_part = ".".join(a.replace("_", "") for a in archs)
    return ".".join(p for p in (cu, torch_part, arch_part) if p)


def _prebuilt_info(path: str) -> dict:
    """build_info() of a prebuilt engine._C (loaded from its file; torch is imported)."""
    import importlib.util

    if not Path(path).is_file():
        sys.exit(f"pipeline-engine: PE_PREBUILT_C={path!r} is not a file")
    spec = importlib.util.spec_from_file_location("engine._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.build_info())


@functools.cache
def _cxx_runtime():
    """engine/tooling/cxx_runtime.py, loaded by path (engine itself is not importable yet), once."""
    import importlib.util

    path = ROOT / "engine" / "tooling" / "cxx_runtime.py"
    spec = importlib.util.spec_from_file_location("_pe_cxx_runtime", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _use_a_shared_libstdcxx_compiler() -> None:
    """Point CXX/CC at a compiler that links libstdc++ shared, if the configured one does
    not (engine/tooling/cxx_runtime.py: why; the H100 machine's CXX=/opt/gcc/bin/g++ does not)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        env, note = _cxx_runtime().pick_compilers()
    except RuntimeError as exc:
        sys.exit(f"pipeline-engine: {exc}")
    if env:
        print(f"[pipeline-engine] {note}")
        os.environ.update(env)


def _extension():
    prebuilt = os.environ.get("PE_PREBUILT_C", "").strip()
    if prebuilt:
        info = _prebuilt_info(prebuilt)
        print(f"[pipeline-engine] packaging prebuilt engine._C from {prebuilt}: {info}")
        ext = cpp_extension.CppExtension("engine._C", sources=["csrc/bindings.cpp"])
        return ext, _version_tag(bool(info["cuda"]), list(info["cuda_archs"]), info["cuda_version"])
    cuda, why = _want_cuda()
    archs = _cuda_archs() if cuda else []
    gen = _write_build_config(archs)
    sources = ["csrc/arena.cpp", "csrc/bindings.cpp", "csrc/sgd_cpu.cpp"]
    include_dirs = [str(ROOT / "csrc"), str(gen)]
    # -O3 vectorises csrc/sgd_cpu.cpp's loop; no contraction, so its multiply-adds round as
    # written (that file must match torch's rounding bit for bit)
    cxx_flags = ["-O3", "-g0", "-ffp-contract=off"]
    print(f"[pipeline-engine] building engine._C with{'' if cuda else 'out'} CUDA ({why})"
          + (f"; archs {', '.join(archs)}" if cuda else ""))
    if cuda:
        ext = cpp_extension.CUDAExtension(
            "engine._C",
            sources=[*sources, "csrc/cuda/arena_cuda.cu"],
            include_dirs=include_dirs,
            define_macros=[("PE_WITH_CUDA", "1")],
            extra_compile_args={
                "cxx": [*cxx_flags, "-DPE_WITH_CUDA=1"],
                "nvcc": ["-O2", "-DPE_WITH_CUDA=1"],
            },
        )
    else:
        ext = cpp_extension.CppExtension(
            "engine._C",
            sources=sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
        )
    return ext, _version_tag(cuda, archs)


class _BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension (ninja), plus PE_PREBUILT_C: copy a module built elsewhere; a
    module it compiled must link libstdc++ shared (engine/tooling/cxx_runtime.py) or the build fails."""

    def build_extension(self, ext) -> None:
        prebuilt = os.environ.get("PE_PREBUILT_C", "").strip()
        if prebuilt and ext.name == "engine._C":
            dest = Path(self.get_ext_fullpath(ext.name))
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(prebuilt, dest)
            return
        super().build_extension(ext)
        built = Path(self.get_ext_fullpath(ext.name))
        runtime = _cxx_runtime()
        if sys.platform.startswith("linux") and not runtime.links_shared(built):
            sys.exit(f"pipeline-engine: {runtime.static_problem(built)}")


if not os.environ.get("PE_PREBUILT_C", "").strip():
    _use_a_shared_libstdcxx_compiler()
ext, tag = _extension()

setup(
    # the kernels live in triton_kernels/ but install as engine.triton_kernels: a top-level
    # "triton_kernels" would collide with the Triton project's package of that name
    packages=[*find_packages(include=["engine", "engine.*"]), "engine.triton_kernels"],
    package_dir={"engine.triton_kernels": "triton_kernels"},
    ext_modules=[ext],
    cmdclass={"build_ext": _BuildExt},
    # egg_info appends tag_build to the version pyproject.toml reads from engine/_version.py
    options={"egg_info": {"tag_build": f"+{tag}" if tag else ""}},
    zip_safe=False,
)
