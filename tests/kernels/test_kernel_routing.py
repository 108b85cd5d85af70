"""The kernel tests route to the device the kernels can run on, checked on CPU.

On a GPU machine conftest.py leaves TRITON_INTERPRET unset, so Triton compiles the kernels
and refuses CPU tensors: a test that builds a ``fused=True`` optimizer over a CPU model passes
in CPU CI (interpreter on) and fails on the GPU. That once cost 36 failures in
tests/optim/test_optim_fused.py. Running the kernel test modules here with TRITON_INTERPRET=0 puts
them in the same "compiled Triton" state with no GPU: each test must then run on the
kernel-test device (tests/kernel_support.py) and skip with its reason, never fail.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
# every module that may launch kernels: builds fused=True optimizers or imports triton_kernels
# (not the helpers, nor the ahead-of-time compile test, which compiles for sm_90 and launches
# nothing and takes minutes)
_LAUNCHES = re.compile(r"fused\s*=\s*True|^\s*(from|import)\s+(engine\.)?triton_kernels", re.M)
_NOT_LAUNCHING = {"conftest.py", "kernel_support.py", "test_triton_aot.py", Path(__file__).name}
# Known to fail on a GPU machine too (found by this test, owned elsewhere): float64 CPU params
# with fused=True are refused by the interpreter check in engine/optim/validation.py before the
# dtype fallback the test expects. Remove the entry once that is fixed (engine: check only the
# params the kernels would take; or the test: put its params on kernel_support.DEVICE).
KNOWN_FAILING: list[str] = []


def kernel_modules() -> list[Path]:
    found = sorted(
        p for p in TESTS.rglob("*.py")
        if p.name not in _NOT_LAUNCHING and _LAUNCHES.search(p.read_text())
    )
    names = {p.name for p in found}
    assert {"test_optim_fused.py", "test_kernels_sgd.py", "test_kernels_adam.py"} <= names, names
    return found


@pytest.mark.slow  # ~15 s: a pytest run of the kernel test modules, nearly all skipped
def test_kernel_tests_skip_not_fail_when_triton_is_compiled_without_a_gpu(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")  # no GPU on GPU hosts too
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=-rfE --strict-markers",  # a readable tail: failures only, not 300 skips
         *(f"--deselect={k}" for k in KNOWN_FAILING if (TESTS.parent / k.split("::")[0]).exists()),
         f"--junitxml={junit}", *map(str, kernel_modules())],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"kernel tests failed with Triton compiled and no GPU:\n{tail}"
    cases = ET.parse(junit).getroot().iter("testcase")
    outcome: dict[str, str] = {}
    for case in cases:
        skipped = case.find("skipped")
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome[name] = "passed" if skipped is None else skipped.get("message", "")
    kernel_skips = [n for n, o in outcome.items() if "TRITON_INTERPRET=1" in o]
    # test_optim_fused: 28 fused-vs-reference, 1 dispatch, 1 fallback, 6 flat-path tests
    fused_skips = [n for n in kernel_skips if "test_optim_fused" in n]
    assert len(fused_skips) >= 36, (len(fused_skips), tail)
    # what needs no kernel still runs: the reference paths and the clear error for CPU tensors
    ran = {n.rsplit("::", 1)[1] for n, o in outcome.items() if o == "passed"}
    assert "test_fused_true_on_cpu_without_interpreter_is_a_clear_error" in ran, ran
    assert any(n.startswith("test_flat_path_equals_per_tensor_path[") and "reference" in n
               for n in ran), ran
