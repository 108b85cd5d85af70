"""bench/pipeline_nccl.py on a CPU machine: its dry run (every case over the NCCL twin, tiny
sizes) runs end to end under torchrun, writes the ratio schema with the world size in every
row, and the engine's losses equal torch.distributed.pipelining's (the same math, so the
multi-GPU run's speed ratio compares like with like); its statistics and result merging,
checked on numbers whose answer is known."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from bench_support import load_bench
from distributed_support import RANKS

ROOT = Path(__file__).resolve().parents[2]
harness = load_bench("harness")
bench = load_bench("pipeline_nccl")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("pipeline_nccl")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "bench" / "pipeline_nccl.py"), "--dry-run", "--ranks",
           str(RANKS), "--out", str(out), "--label", "test"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    return run, out


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_dry_run_writes_every_case_in_the_ratio_schema(dry_run) -> None:
    run, out = dry_run
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    path = out / "pipeline_nccl-cpu-twin.csv"
    with path.open(newline="") as handle:
        assert next(csv.reader(handle)) == harness.RATIO_COLUMNS
    rows = harness.read_ratio_csv(path)
    assert [(r.benchmark, r.case) for r in rows] == [
        ("vs_torch", "gpipe"), ("vs_torch", "1f1b"),
        ("p2p", "latency 4B"), ("p2p", "latency 1KiB"), ("p2p", "bandwidth 64KiB"),
        ("hidden", "1f1b"),
    ]
    assert [r.peer for r in rows[:2]] == ["torch ScheduleGPipe", "torch Schedule1F1B"]
    assert {r.peer for r in rows[2:5]} == {"bare dist.batch_isend_irecv"}
    for r in rows:
        assert r.extra["world"] == RANKS and r.rounds == 3 and r.label == "test"
        assert r.torch == torch.__version__ and r.device.startswith("cpu")
        assert datetime.datetime.fromisoformat(r.date).year >= 2024
        assert r.note.startswith("dry run")
    for r in rows[:5]:  # paired ratios
        assert r.ci_low <= r.median_ratio <= r.ci_high and r.candidate_ms > 0 and r.peer_ms > 0
    for r in rows[2:5]:
        assert r.extra["bytes"] in (4, 1024, 65536) and r.extra["pairs"] == RANKS // 2
        assert r.extra["candidate_GBps"] > 0 and r.extra["peer_GBps"] > 0
    hidden = rows[5]
    assert len(hidden.extra["X_ms"]) == len(hidden.extra["Y_ms"]) == 3
    assert {"hidden", "hidden_low", "hidden_high"} <= set(hidden.extra)
    # the goals are printed beside the numbers, not judged on a CPU
    assert run.stdout.count("not judged (CPU dry run)") == 3, run.stdout


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_dry_run_engine_losses_equal_torch_pipelining(dry_run) -> None:
    run, out = dry_run
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for r in harness.read_ratio_csv(out / "pipeline_nccl-cpu-twin.csv")[:2]:
        got, want = r.extra["engine_losses"], r.extra["torch_losses"]
        assert len(got) == len(want) == 3
        assert len(set(want)) == 3  # three mini-batches, three losses: a training run
        for g, w in zip(got, want, strict=True):
            assert math.isclose(g, w, rel_tol=bench.LOSS_RTOL), (r.case, got, want)


def test_hidden_fraction_and_its_interval() -> None:
    # payloads add 1 ms of 10 ms: 90 % hidden; X and Y with some spread
    x = [1.0e-3, 0.9e-3, 1.1e-3, 1.05e-3, 0.95e-3]
    y = [10.0e-3, 9.5e-3, 10.5e-3, 9.8e-3, 10.2e-3]
    hidden, low, high, exposed, y_low, y_high = bench.hidden_stats(x, y)
    assert hidden == pytest.approx(0.9) and exposed == pytest.approx(0.1)
    assert low < hidden < high and 0.85 < low and high < 0.95
    assert 9.5e-3 <= y_low <= 10e-3 <= y_high <= 10.5e-3
    assert bench.hidden_stats(x, y) == (hidden, low, high, exposed, y_low, y_high)  # fixed seed
    # a transfer-only time whose interval reaches zero: undefined, not a number
    h, lo, hi, ex, y_low, _ = bench.hidden_stats(x, [2e-4, -1e-4, 1e-4, -2e-4, 0.0])
    assert all(math.isnan(v) for v in (h, lo, hi, ex)) and y_low <= 0


def test_rows_of_another_world_size_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"

    def row(case: str, world: int, ratio: float) -> object:
        res = harness.paired(lambda: None, lambda: None, rounds=2, warmup=0, inner=1)
        return dataclasses.replace(res.row("vs_torch", case, "c", "p", extra={"world": world}),
                                   median_ratio=ratio)

    bench.write_rows([row("gpipe", 2, 1.0), row("1f1b", 2, 1.0)], path, 2)
    bench.write_rows([row("gpipe", 4, 2.0)], path, 4)
    bench.write_rows([row("gpipe", 2, 3.0)], path, 2)  # a rerun at 2 ranks replaces its rows
    got = [(r.case, r.extra["world"], r.median_ratio) for r in harness.read_ratio_csv(path)]
    assert got == [("gpipe", 4, 2.0), ("gpipe", 2, 3.0)]


def test_options_dry_run_defaults_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    _, args = bench.parse(["--dry-run"])
    assert args.dry_run and args.width == bench.DRY_DEFAULTS["width"]
    assert args.sizes == [4, 1024, 65536]
    _, args = bench.parse(["--dry-run", "--width", "32", "--p2p-sizes", "8,2KiB"])
    assert args.width == 32 and args.sizes == [8, 2048]
    # the GPU defaults: 1 MiB activations
    assert bench.GPU_DEFAULTS["micro_batch"] * bench.GPU_DEFAULTS["width"] * 4 == 1 << 20
    for bad, words in ((["--p2p-sizes", "6"], "whole number"), (["--chunks", "0"], "--chunks 0"),
                       (["--p2p-sizes", "lots"], "comma-separated")):
        with pytest.raises(SystemExit):
            bench.parse(["--dry-run", *bad])
        assert words in capsys.readouterr().err
