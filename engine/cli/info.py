"""``python -m engine info``: what this installation can do on this machine.

The first question of every bug report is "which build, which GPU, which Triton mode";
this module answers it in one place so users and CI print the same facts.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any


def collect() -> dict[str, Any]:
    """Return versions, extension build facts, Triton mode and GPU name as a flat dict."""
    import torch

    import engine

    facts: dict[str, Any] = {
        "engine": engine.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:  # triton is optional on CPU machines
        facts["triton"] = None

    try:
        from engine import _C

        build = dict(_C.build_info())
        facts["extension"] = "built"
        facts["extension_cuda"] = bool(build.get("cuda"))
        facts["extension_cuda_archs"] = list(build.get("cuda_archs", []))
        facts["extension_cuda_version"] = build.get("cuda_version")
        facts["extension_torch"] = build.get("torch_version")
        facts["extension_libstdcxx"] = libstdcxx_linkage(_C.__file__)
    except ImportError as exc:
        facts["extension"] = f"not importable: {exc}"
        facts["extension_cuda"] = False
        facts["extension_cuda_archs"] = []

    cuda = torch.cuda.is_available()
    facts["gpu"] = torch.cuda.get_device_name(0) if cuda else None
    if os.environ.get("TRITON_INTERPRET") == "1":
        facts["triton_mode"] = "interpreted (TRITON_INTERPRET=1)"
    elif facts["triton"] is None:
        facts["triton_mode"] = "unavailable (triton not installed)"
    elif cuda:
        facts["triton_mode"] = "compiled for the GPU"
    else:
        facts["triton_mode"] = (
            "unavailable without a GPU; set TRITON_INTERPRET=1 to interpret kernels on CPU"
        )
    return facts


def libstdcxx_linkage(path: str) -> str:
    """"shared" when the extension at ``path`` uses the process's libstdc++ (as it must),
    else what is wrong and what to do (engine.tooling.cxx_runtime: why)."""
    from engine.tooling.cxx_runtime import links_shared, static_problem

    try:
        shared = links_shared(path)
    except (OSError, ValueError) as exc:
        return f"unknown ({exc})"
    return "shared" if shared else f"STATIC: {static_problem(path)}"


def format_facts(facts: dict[str, Any]) -> str:
    width = max(len(k) for k in facts)
    lines = []
    for key, value in facts.items():
        if isinstance(value, list):
            value = ", ".join(value) if value else "-"
        lines.append(f"{key:<{width}}  {value if value is not None else '-'}")
    return "\n".join(lines)


def main() -> int:
    print(format_facts(collect()))
    sys.stdout.flush()
    return 0
