"""bench/pipeline_gloo.py: the engine's zbh1 against torch's zero-bubble schedule and the
engine's interleaved 1F1B against torch's (2 stages per rank), the engine's zbv and dualpipev
against torch's ScheduleZBVZeroBubble and ScheduleDualPipeV (2 stages per rank placed as a V)
run end to end under gloo and write one paired ratio row each (a smoke run: 2 ranks, tiny
model, 2 rounds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from bench_support import load_bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_zbh1_vs_torch_zero_bubble_quick_run(tmp_path: Path) -> None:
    harness = load_bench("harness")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "bench" / "pipeline_gloo.py"), "--ranks", "2",
           "--cases", "zbh1", "interleaved", "zbv", "dualpipev", "--rounds", "2", "--steps", "1", "--warmup", "0",
           "--chunks", "4",
           "--micro-batch", "2", "--width", "8", "--layers", "1", "--timeout", "60",
           "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    row, inter, zbv, dpv = harness.read_ratio_csv(tmp_path / "pipeline_gloo.csv")
    assert (row.case, row.candidate) == ("zbh1", "engine zbh1")
    assert row.peer == "torch ScheduleInterleavedZeroBubble, 1 stage/rank"
    assert (inter.case, inter.candidate) == ("interleaved", "engine interleaved v=2")
    assert inter.peer == "torch ScheduleInterleaved1F1B v=2" and inter.extra["virtual"] == 2
    assert (zbv.case, zbv.candidate, zbv.peer) == ("zbv", "engine zbv", "torch ScheduleZBVZeroBubble")
    assert (dpv.case, dpv.peer) == ("dualpipev", "torch ScheduleDualPipeV") and dpv.extra["virtual"] == 2
    for r in (row, inter, zbv, dpv):
        assert r.rounds == 2 and r.ci_low <= r.median_ratio <= r.ci_high
    assert (tmp_path / "pipeline_gloo.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_tensor_parallel_cost_quick_run(tmp_path: Path) -> None:
    """--cases tp: TP=2 x PP=2 against TP=1 x PP=2 on the same 4 processes, one paired row."""
    harness = load_bench("harness")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "bench" / "pipeline_gloo.py"), "--ranks", "4",
           "--cases", "tp", "--rounds", "2", "--steps", "1", "--warmup", "0", "--chunks", "2",
           "--micro-batch", "2", "--width", "8", "--layers", "1", "--timeout", "60",
           "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (row,) = harness.read_ratio_csv(tmp_path / "pipeline_gloo.csv")
    assert (row.benchmark, row.case, row.candidate) == ("tp_cost", "tp", "engine 1f1b TP=2 x PP=2")
    assert row.peer.startswith("engine 1f1b TP=1 x PP=2")
    assert row.extra["tp"] == 2 and row.extra["stages"] == 2
    assert row.rounds == 2 and row.ci_low <= row.median_ratio <= row.ci_high
