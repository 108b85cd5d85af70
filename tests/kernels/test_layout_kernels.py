"""The kernel wing's layout (issue 28 item 5): the Triton kernels import nothing of
``engine.optim``; the rules they share with the reference math live in the torch-only leaf
``engine.update_rules``. So the package-level circle optim <-> triton_kernels (a kernel
imported ``engine.optim.functional``, and with it every optimizer, while
``engine.optim.dispatch`` imported the kernels back) cannot come back. Each gate has a twin
that feeds it a bad sample, so a gate that cannot fail shows."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "triton_kernels"  # installed as engine.triton_kernels (setup.py package_dir)
LEAF = ROOT / "engine" / "update_rules.py"


def imported_names(source: str) -> set[str]:
    """Every module ``source`` imports: import statements anywhere (module level, inside
    functions, under ``if TYPE_CHECKING:``) and ``importlib.import_module("...")`` calls
    with a literal or f-string name (its literal head)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                found.add(str(arg.values[0].value))
    return found


def optim_imports(source: str) -> list[str]:
    return sorted(n for n in imported_names(source)
                  if n == "engine.optim" or n.startswith("engine.optim."))


def engine_imports(source: str) -> list[str]:
    return sorted(n for n in imported_names(source) if n == "engine" or n.startswith("engine."))


def test_kernels_import_nothing_of_engine_optim() -> None:
    offenders = {p.name: hits for p in sorted(KERNELS.glob("*.py"))
                 if (hits := optim_imports(p.read_text()))}
    assert offenders == {}, ("the kernels take their shared rules from engine.update_rules; "
                             f"these import engine.optim: {offenders}")


def test_kernel_gate_can_fail() -> None:
    bad = ("from engine.optim.functional import spike_coeffs\n"
           "def f():\n    import engine.optim.dispatch\n"
           "import importlib\nm = importlib.import_module(f'engine.optim.{x}')\n")
    assert optim_imports(bad) == ["engine.optim.", "engine.optim.dispatch",
                                  "engine.optim.functional", "engine.optim.functional.spike_coeffs"]
    assert optim_imports("from engine.update_rules import spike_coeffs\n") == []


def test_the_rules_leaf_imports_no_engine_module() -> None:
    assert engine_imports(LEAF.read_text()) == [], "engine.update_rules must stay a torch-only leaf"
    assert engine_imports("from engine.optim import SGD\n") == ["engine.optim", "engine.optim.SGD"]


def test_importing_the_launchers_loads_no_optimizer() -> None:
    """The circle as it ran: importing a kernel module used to import engine.optim (every
    optimizer). In a fresh interpreter, after importing every launcher, no engine.optim
    module is loaded."""
    code = ("import sys; import engine.triton_kernels.sgd, engine.triton_kernels.adaptive, "
            "engine.triton_kernels.multi; "
            "print(sorted(m for m in sys.modules if m.startswith('engine.optim')))")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
