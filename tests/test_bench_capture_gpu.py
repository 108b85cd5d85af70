"""bench/pipeline_capture_gpu.py's logic on the CPU (a recording twin stands in for the
graph; tiny sizes): every pair of both schedules is measured and the engine side replays."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.runtime.exec.capture import use_backend
from engine.testing.graph_twin import RecordingTwin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import pipeline_capture_gpu as bench  # noqa: E402


def test_every_pair_runs_and_the_engine_replays() -> None:
    twin = RecordingTwin()
    with use_backend(twin):
        rows = bench.run(torch.device("cpu"), width=8, depth=3, batch=8, chunks=2, rounds=1,
                         warmup=0, min_time=0.0, log=lambda _: None)
    assert [(r.candidate, r.peer) for r in rows] == [
        ("engine captured", "plain loop eager"), ("engine eager", "plain loop eager"),
        ("engine captured", "engine eager")] * 2
    assert {r.extra["schedule"] for r in rows} == {"1f1b", "gpipe"}
    assert twin.captures == 2 and twin.replays > 2
    assert all(r.median_ratio > 0 for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CLI measures on a GPU")
def test_cli_without_a_gpu_writes_nothing(tmp_path: Path, capsys) -> None:
    assert bench.main(["--out", str(tmp_path)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_pb_pairs_run_and_the_engine_replays() -> None:
    """bench/pipeline_pb_capture_gpu.py on the CPU: a tape twin stands in for the graph (the
    reference optimizer path, which the tape can replay), tiny sizes."""
    import pipeline_pb_capture_gpu as pb

    from engine.testing.capture_audit import _reference_optimizer
    from engine.testing.graph_twin import TapeTwin

    twin = TapeTwin()
    with use_backend(twin), _reference_optimizer():
        rows = pb.run(torch.device("cpu"), widths=(8,), layers=4, stages=2, rounds=1, warmup=0,
                      min_time=0.0, log=lambda _: None)
    assert [(r.candidate, r.peer) for r in rows] == [
        ("engine captured", "per-sample loop eager"), ("engine captured", "per-sample loop eager"),
        ("engine eager", "per-sample loop eager"), ("engine captured", "engine eager")]
    assert twin.captures == 2 and twin.replays > 2
    assert all(r.median_ratio > 0 and r.extra["width"] == 8 for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CLI measures on a GPU")
def test_pb_cli_without_a_gpu_writes_nothing(tmp_path: Path, capsys) -> None:
    import pipeline_pb_capture_gpu as pb

    assert pb.main(["--out", str(tmp_path)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
