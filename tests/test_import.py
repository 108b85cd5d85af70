"""Importing the package in a fresh interpreter: ``engine._C`` loads without a prior
``import torch``, and ``import engine`` alone stays cheap (no torch)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *sys.path])
    # torch's own lib folder on LD_LIBRARY_PATH would hide the bug: the extension must find
    # libc10/libtorch through `import torch`, not through the environment
    torch_spec = importlib.util.find_spec("torch")
    assert torch_spec is not None and torch_spec.submodule_search_locations
    torch_lib = os.path.realpath(os.path.join(torch_spec.submodule_search_locations[0], "lib"))
    if "LD_LIBRARY_PATH" in env:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in env["LD_LIBRARY_PATH"].split(os.pathsep) if os.path.realpath(p) != torch_lib
        )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )


def test_extension_imports_without_importing_torch_first() -> None:
    if importlib.util.find_spec("engine._C") is None:
        pytest.skip("engine._C is not built")
    proc = _fresh_python("import engine._C; print(engine._C.build_info())")
    assert proc.returncode == 0, proc.stderr
    assert "torch_version" in proc.stdout


def test_import_engine_does_not_import_torch() -> None:
    proc = _fresh_python("import sys, engine; print('torch' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_kernels_install_under_the_engine_namespace(tmp_path) -> None:
    """The kernels folder installs as engine.triton_kernels; the top-level name, which the
    Triton project's own package uses, is not ours (outside the source tree)."""
    code = (
        "import importlib.util, json;"
        "top = importlib.util.find_spec('triton_kernels');"
        "ours = importlib.util.find_spec('engine.triton_kernels');"
        "print(json.dumps([top.origin if top else None, ours.origin if ours else None]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    top, ours = json.loads(proc.stdout)
    repo = str(Path(__file__).resolve().parents[1])
    assert ours is not None and ours.startswith(os.path.join(repo, "triton_kernels"))
    assert top is None or not top.startswith(repo)


#: module names that moved, kept importable with a DeprecationWarning until 0.3 (engine._deprecation.py)
MOVED = {
    "engine.hf": "engine.integrations.hf",
    "engine.models": "engine.demo.models",
    "engine.data": "engine.demo.data",
    "engine.corpus": "engine.demo.corpus",
    "engine.testing.graph_twin": "engine.runtime.capture.graph_twin",
    "engine.testing.capture_audit": "engine.runtime.capture.audit",
    "engine.testing.carry_audit": "engine.runtime.capture.carry_audit",
    "engine.testing.dispatch_trace": "engine.runtime.capture.dispatch_trace",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_keeps_its_old_name_with_a_deprecation_warning(old: str) -> None:
    import importlib

    import engine._deprecation

    new = importlib.import_module(MOVED[old])
    with pytest.warns(DeprecationWarning) as caught:
        module = importlib.reload(importlib.import_module(old))
    text = str(caught[0].message)
    assert MOVED[old] in text and f"removed in {engine._deprecation.REMOVED_IN}" in text
    assert module.__all__ == new.__all__
    assert all(getattr(module, name) is getattr(new, name) for name in new.__all__)
