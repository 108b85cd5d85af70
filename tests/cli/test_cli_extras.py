"""``python -m engine`` without the optional packages of the ``cli`` extra: one line naming
the package and ``pip install pipeline-engine[cli]``, exit status 2, no traceback; a missing
module that is not part of the extra (a real bug) still raises."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

import engine.cli.train
from engine.__main__ import main

REPO = Path(__file__).resolve().parents[2]
TINY = ["--dataset", "iris", "--layers", "4", "--width", "8", "--stages", "2", "--chunks", "2"]

# `python -m engine ARGV...` as if `module` were not installed: a finder placed first on
# sys.meta_path raises what the import system raises for a missing top-level module
_WRAPPER = """
import importlib.abc, runpy, sys
blocked, sys.argv = sys.argv[1], ["engine", *sys.argv[2:]]
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
runpy.run_module("engine", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    ("command", "module", "package"),
    [("train", "tqdm", "tqdm"), ("train", "sklearn", "scikit-learn"), ("compare", "tqdm", "tqdm")],
)
def test_a_missing_optional_package_gives_one_line_and_status_2(
    tmp_path: Path, command: str, module: str, package: str
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPER, module, command, *TINY, "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "pip install pipeline-engine[cli]" in lines[0] and package in lines[0]
    assert not (tmp_path / "run").exists()  # nothing ran


def test_a_missing_module_outside_the_extra_still_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(args: argparse.Namespace) -> int:
        raise ModuleNotFoundError("No module named 'numpy'", name="numpy")

    monkeypatch.setattr(engine.cli.train, "run", broken)
    with pytest.raises(ModuleNotFoundError, match="numpy"):
        main(["train", *TINY])
