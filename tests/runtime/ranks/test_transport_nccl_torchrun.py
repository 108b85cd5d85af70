"""``ENGINE_NCCL_TWIN=1 torchrun --standalone --nproc-per-node 4 script.py`` with
``Pipeline(transport="nccl")``: the engine initialises the process group itself (the path a
GPU job takes, whose first line used to fail with UnboundLocalError), over the NCCL twin on
this CPU machine, and every schedule family trains bit for bit like the local run (the
families of one stage per rank and those a program places, two stages per rank).

One torchrun job of 4 processes, ~30-60 s on 2 cores: slow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from distributed_support import configs

ROOT = Path(__file__).resolve().parents[3]
R = 4


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_engine_initialised_nccl_twin_trains_every_family_like_the_local_run(tmp_path: Path) -> None:
    from nccl_torchrun_job import PLACED

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ENGINE_NCCL_TWIN": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(R),
           str(ROOT / "tests" / "nccl_torchrun_job.py"), str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    names = [*configs(R), *PLACED]
    for rank in range(R):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["backend"] == "nccl_twin", got["backend"]  # the engine chose the twin
        for name in names:
            r = got[name]
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["losses_equal"] and r["weights_equal"], (rank, name, r)
