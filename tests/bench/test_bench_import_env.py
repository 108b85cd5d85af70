"""Importing a bench/ script leaves the importer's environment as it was.

Why: on the GPU machine, pytest collects tests/bench/test_bench_host_cost.py, which loads
bench/host_cost.py; that script used to set TRITON_INTERPRET=1 at import, so every Triton
kernel module the same worker imported afterwards ran through the interpreter on CUDA
tensors (nine Adam/AMSGrad tests failed with "Cannot call @triton.jit'd outside of the
scope of a kernel", GPU run of 2026-11-26). A script may set what it needs in its
``__main__`` path only.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bench_support import BENCH, load_bench

SCRIPTS = sorted(p.stem for p in Path(BENCH).glob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_loading_a_bench_script_changes_no_environment_variable(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as on a GPU machine: the variables the scripts care about are unset
    for var in ("TRITON_INTERPRET", "PE_CPU_LOOP"):
        monkeypatch.delenv(var, raising=False)
    before = dict(os.environ)
    load_bench(name)
    after = dict(os.environ)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert changed == [], f"bench/{name}.py changed {changed} at import"
