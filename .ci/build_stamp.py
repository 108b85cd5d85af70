"""Whether `.ci/install` may reuse the existing build of ``engine._C``.

Why: ``pip install -e .`` recompiles the C++ extension every time (about a minute on two
idle cores, two when they are shared), and the README's commands run `.ci/install` before
every comparison and test run. A build is reused only when everything that decides its bits
is unchanged, recorded in a stamp written after a successful install:

* the build inputs: every file under csrc/, setup.py, CMakeLists.txt, pyproject.toml and
  engine/_version.py (their paths and contents, hashed);
* the toolchain: torch's version and CUDA version, Python's version, the C++ compiler's
  ``--version`` line, and the local GPUs' compute capabilities when setup.py would read them;
* the build flags setup.py and torch's extension builder read from the environment
  (PE_BUILD_CUDA, TORCH_CUDA_ARCH_LIST, PE_PREBUILT_C and that file's hash, CC, CXX, ...);
* the result: the built ``engine/_C*.so`` file's hash, and the editable install of
  ``pipeline-engine`` pointing at this checkout.

Anything missing or different means rebuild; a fresh machine (no stamp) always builds.

    python3 .ci/build_stamp.py check   # exit 0: reuse (prints why), 1: rebuild (prints why)
    python3 .ci/build_stamp.py write   # after a successful `pip install -e .`
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP = Path("build") / "engine_C.stamp.json"
SOURCES = ("csrc", "setup.py", "CMakeLists.txt", "pyproject.toml", "engine/_version.py")
FLAG_VARS = (
    "PE_BUILD_CUDA", "TORCH_CUDA_ARCH_LIST", "PE_PREBUILT_C", "PE_VERSION_TAG", "CUDA_HOME",
    "CUDA_PATH", "CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "NVCC_FLAGS",
)
DIST = "pipeline-engine"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def source_hash(root: Path = ROOT) -> str:
    """One hash over the build inputs' relative paths and contents (a rename counts too)."""
    h = hashlib.sha256()
    for name in SOURCES:
        top = root / name
        files = sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else [top]
        for p in files:
            if not p.exists() or "__pycache__" in p.parts:
                continue
            h.update(p.relative_to(root).as_posix().encode() + b"\0")
            h.update(_sha256(p).encode() + b"\0")
    return h.hexdigest()


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or ""
    if not cxx:
        return ""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return cxx
    return f"{cxx}: {(out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else ''}"


def toolchain(env: dict[str, str] | None = None) -> dict[str, object]:
    """What the build depends on besides the sources: torch, Python, compiler, flags."""
    env = dict(os.environ) if env is None else env
    import torch

    info: dict[str, object] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "compiler": _compiler(),
        "env": {k: env[k] for k in FLAG_VARS if k in env},
    }
    prebuilt = env.get("PE_PREBUILT_C", "").strip()
    if prebuilt and Path(prebuilt).is_file():
        info["prebuilt_sha256"] = _sha256(Path(prebuilt))
    if torch.version.cuda and not env.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.is_available():
        # setup.py compiles for the local GPUs' archs when TORCH_CUDA_ARCH_LIST is unset
        info["gpu_caps"] = sorted(
            {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        )
    return info


def fingerprint(root: Path = ROOT, env: dict[str, str] | None = None) -> dict[str, object]:
    return {"sources": source_hash(root), **toolchain(env)}


def built_module(root: Path = ROOT) -> Path | None:
    found = sorted((root / "engine").glob("_C*.so")) + sorted((root / "engine").glob("_C*.pyd"))
    return found[0] if len(found) == 1 else None


def installed_here(root: Path = ROOT) -> str | None:
    """None when pipeline-engine is installed editable from ``root``; else what is wrong."""
    import importlib.metadata as md

    try:
        dist = md.distribution(DIST)
    except md.PackageNotFoundError:
        return f"{DIST} is not installed"
    try:
        url = json.loads(dist.read_text("direct_url.json") or "{}")
    except json.JSONDecodeError:
        return f"{DIST}'s direct_url.json is unreadable"
    if not url.get("dir_info", {}).get("editable"):
        return f"{DIST} is installed, but not editable"
    if url.get("url") != root.as_uri():
        return f"{DIST} is installed from {url.get('url')}, not {root.as_uri()}"
    return None


def decide(root: Path = ROOT, env: dict[str, str] | None = None) -> tuple[bool, str]:
    """(reuse, why): reuse only when the stamp, the build and the install all match."""
    stamp_path = root / STAMP
    if not stamp_path.is_file():
        return False, f"no stamp at {STAMP} (first build here)"
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False, f"stamp {STAMP} is unreadable"
    module = built_module(root)
    if module is None:
        return False, "no single engine/_C*.so to reuse"
    if stamp.get("module_sha256") != _sha256(module):
        return False, f"{module.name} is not the file the stamp recorded"
    now = fingerprint(root, env)
    changed = [k for k in sorted(set(now) | set(stamp.get("fingerprint", {})))
               if now.get(k) != stamp.get("fingerprint", {}).get(k)]
    if changed:
        return False, "changed since the last build: " + ", ".join(changed)
    problem = installed_here(root)
    if problem:
        return False, problem
    return True, f"sources, torch {now['torch']} and build flags unchanged since the last build"


def write(root: Path = ROOT, env: dict[str, str] | None = None) -> Path:
    module = built_module(root)
    if module is None:
        raise SystemExit("build_stamp: no single engine/_C*.so after the install; not stamping")
    stamp = {"fingerprint": fingerprint(root, env), "module_sha256": _sha256(module)}
    path = root / STAMP
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def main(argv: list[str]) -> int:
    if argv[1:] == ["check"]:
        reuse, why = decide()
        print(f"[install] {'reusing engine._C' if reuse else 'building engine._C'}: {why}")
        return 0 if reuse else 1
    if argv[1:] == ["write"]:
        if built_module() is None:  # e.g. an install that kept the module elsewhere
            print("[install] no single engine/_C*.so here to stamp; the next install rebuilds")
            return 0
        print(f"[install] stamped the build in {write().relative_to(ROOT)}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
