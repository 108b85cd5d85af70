"""A real ``torchrun --max-restarts 1`` job (2 CPU ranks, gloo) whose rank 1 dies abruptly
mid-run on the first attempt: torchrun restarts the job, which resumes from the last complete
checkpoint by itself (bench/train_resumable.py) and ends with the weights of an uninterrupted
run, bit for bit. ~30 s on 2 cores (two job starts), hence slow."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_support import load_bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_killed_rank_restarts_and_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the engine must cope without it
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", str(ROOT / "bench" / "train_resumable.py"),
        "--ckpt", str(tmp_path / "ckpt"), "--steps", "12", "--save-every", "3",
        "--die-at", "7", "--die-rank", "1", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "attempt 0: starting at step 0" in log
    for r in (0, 1):  # the second attempt resumed from the step-6 checkpoint, not from 0
        assert f"rank {r} attempt 1: starting at step 6" in log, log[-4000:]
        assert f"rank {r} attempt 1: done at step 12" in log

    script = load_bench("train_resumable")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = script.build(2, "1f1b", "local")
        script.train(ref, 12, 3, None)
    finally:
        torch.set_num_threads(threads)
    for r in (0, 1):
        got = load_file(str(tmp_path / "out" / f"rank{r}.safetensors"))
        want = ref.stages[r].module.state_dict()
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), f"rank {r} {k}"
