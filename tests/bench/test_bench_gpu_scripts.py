"""The GPU benchmarks on a CPU machine: they refuse cleanly, and what can run on CPU runs.

bench/pipeline_gpu.py (pb batch-1 on one GPU vs a per-sample loop) and
bench/l2_persistence.py need a CUDA GPU for their numbers; here: the no-GPU exit (status 0,
a message, nothing written), pipeline_gpu's measurement logic on the CPU, its switch to
``cuda_graphs=True`` that activates only when engine.Pipeline accepts the keyword, and the
harness features l2_persistence relies on (per-side setup outside the timer, ratios of a
probe's per-round values).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_support import load_bench

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit path")

harness = load_bench("harness")


def _script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(BENCH / name), *args], env=env,
                          capture_output=True, text=True, timeout=300)


@NO_GPU
@pytest.mark.parametrize("script,words", [
    ("pipeline_gpu.py", "needs a CUDA GPU"),
    ("l2_persistence.py", "no GPU"),
    ("optim.py", "no CUDA GPU"),
    ("lm_gpu.py", "needs a CUDA GPU"),
    ("host_cost.py --device cuda", "--device cuda needs a CUDA GPU"),
])
def test_gpu_scripts_refuse_without_a_gpu_and_write_nothing(tmp_path: Path, script: str, words: str) -> None:
    out = tmp_path / "out"
    script, *args = script.split()
    proc = _script(script, *args, "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert words in proc.stdout
    assert not out.exists()


def test_optim_help_lists_the_quick_flag() -> None:
    proc = _script("optim.py", "--help")
    assert proc.returncode == 0 and "--quick" in proc.stdout and "--device" in proc.stdout


def test_pipeline_gpu_logic_runs_on_cpu(tmp_path: Path) -> None:
    pg = load_bench("pipeline_gpu")
    torch.set_num_threads(1)
    rows = pg.run(torch.device("cpu"), rounds=2, warmup=1, min_time=0.002, log=lambda _m: None)
    (row,) = rows
    assert row.benchmark == "pipeline_gpu" and row.peer == "plain per-sample loop"
    assert row.extra["target_ratio"] == pytest.approx(1 / 3) and row.extra["cuda_graphs"] == 0.0
    assert "engine losses finite" in row.note and row.ci_low <= row.median_ratio <= row.ci_high
    harness.write_ratio_csv(rows, tmp_path / "pipeline_gpu.csv")
    back = harness.read_ratio_csv(tmp_path / "pipeline_gpu.csv")
    # (the script's rows are harness.RatioRow of its own import of bench/harness.py)
    assert [dataclasses.asdict(r) for r in back] == [dataclasses.asdict(r) for r in rows]


def test_pipeline_gpu_uses_cuda_graphs_only_where_pipeline_accepts_it(monkeypatch) -> None:
    pg = load_bench("pipeline_gpu")
    real = pg.engine.Pipeline
    has = "cuda_graphs" in inspect.signature(real).parameters
    assert pg.graphs_keyword() == has
    cuda = torch.device("cuda")  # cases() does not touch the device
    assert [c[0] for c in pg.cases(cuda)] == (["streams", "streams+graphs"] if has else ["streams"])

    seen: dict[str, object] = {}

    def with_graphs(stages, *, cuda_graphs: bool = False, **kw):  # a Pipeline that has it
        seen.update(kw, cuda_graphs=cuda_graphs)

    monkeypatch.setattr(pg.engine, "Pipeline", with_graphs)
    assert pg.graphs_keyword()
    assert [c[0] for c in pg.cases(cuda)] == ["streams", "streams+graphs"]
    pg.pipeline([], streams=True, graphs=True)
    assert seen["cuda_graphs"] is True and seen["cuda_streams"] is True
    assert seen["schedule"] == "pb" and seen["weight_prediction"] == "lwp"

    def without_graphs(stages, **kw):
        seen.clear()
        seen.update(kw)

    monkeypatch.setattr(pg.engine, "Pipeline", without_graphs)
    assert not pg.graphs_keyword()
    assert [c[0] for c in pg.cases(cuda)] == ["streams"]
    pg.pipeline([], streams=True, graphs=False)
    assert "cuda_graphs" not in seen


def test_harness_setup_runs_per_side_before_each_block_outside_the_timer() -> None:
    events: list[str] = []
    res = harness.paired(lambda: events.append("c"), lambda: events.append("p"), rounds=3,
                         warmup=1, inner=2, setup=lambda side: events.append(f"setup:{side}"))
    assert res.rounds == 3
    assert events == [
        "setup:candidate", "c", "setup:peer", "p",  # warm-up
        "setup:candidate", "c", "c", "setup:peer", "p", "p",  # round 1: AB
        "setup:peer", "p", "p", "setup:candidate", "c", "c",  # round 2: BA
        "setup:candidate", "c", "c", "setup:peer", "p", "p",  # round 3: AB
    ]
    # calibration (inner=None) also runs each side after its setup
    events.clear()
    harness.paired(lambda: events.append("c"), lambda: events.append("p"), rounds=1, warmup=0,
                   min_time=0.0, setup=lambda side: events.append(side[0].upper()))
    assert events[:6] == ["C", "c", "P", "p", "C", "c"]


def test_by_probe_gives_a_paired_ratio_of_the_probe() -> None:
    """A probe that measures a time (like l2_persistence's CUDA events) becomes a ratio
    with its own interval; the probe values are per call."""
    side = {"now": ""}

    class FakeDeviceTime:
        name = "dev_s"

        def start(self) -> None:
            return None

        def stop(self, _token: None) -> float:
            return 3.0 if side["now"] == "c" else 2.0  # per block of 2 calls

    res = harness.paired(lambda: side.update(now="c"), lambda: side.update(now="p"), rounds=5,
                         warmup=0, inner=2, probes=[FakeDeviceTime()])
    assert res.probe_rounds["candidate_dev_s_per_call"] == [1.5] * 5
    dev = res.by_probe("dev_s")
    assert dev.stats.median == pytest.approx(1.5) and dev.stats.low == pytest.approx(1.5)
    assert dev.order == res.order and dev.rounds == 5 and res.stats != dev.stats
    row = dev.row("l2_persistence", "case", "persisting", "normal")
    assert row.candidate_ms == pytest.approx(1500.0) and row.peer_ms == pytest.approx(1000.0)
    with pytest.raises(KeyError, match="no probe named 'minflt'"):
        res.by_probe("minflt")


def test_l2_event_probe_sums_the_recorded_pairs() -> None:
    l2 = load_bench("l2_persistence")

    class Ev:
        def __init__(self, t: float) -> None:
            self.t = t

        def elapsed_time(self, end: Ev) -> float:
            return end.t - self.t  # ms, as torch.cuda.Event

    probe = l2.EventTimes()
    probe.pending.append((Ev(0.0), Ev(1.0)))
    probe.start()  # a block starts clean: warm-up events are dropped
    assert probe.pending == []
    probe.pending += [(Ev(0.0), Ev(2.0)), (Ev(5.0), Ev(5.5))]
    assert probe.stop(None) == pytest.approx(2.5e-3)
    assert probe.pending == []


def test_l2_arguments_keep_the_ci_invocation_working() -> None:
    l2 = load_bench("l2_persistence")
    args = l2.parse_args(["--out", "/tmp/x", "--iters", "10", "--warmup", "2", "--layers", "2"])
    assert args.rounds == 10 and args.iters // args.rounds == 1 and args.graph
    args = l2.parse_args(["--iters", "200", "--warmup", "20"])  # .ci/gpu's bench-kernels step
    assert args.rounds == 20 and args.iters // args.rounds == 10
    quick = l2.parse_args(["--quick", "--no-graph"])
    assert quick.rounds == 3 and quick.layers == 2 and not quick.graph


@pytest.mark.cuda
def test_cuda_host_cost_times_real_launches_against_torch_fused(tmp_path: Path) -> None:
    """bench/host_cost.py --device cuda, as .ci/gpu's bench-lm phase runs it, at smoke size:
    every case on CUDA tensors, the kernels launched (compiled Triton, not interpreted)."""
    proc = _script("host_cost.py", "--device", "cuda", "--quick", "--few", "2", "--many", "4",
                   "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = harness.read_ratio_csv(tmp_path / "host_cost.csv")
    assert {r.case for r in rows} >= {"adamw flat vs torch fused", "sgd flat vs torch fused"}
    assert all(r.device == torch.cuda.get_device_name() for r in rows)
    assert all("launched" in r.note for r in rows)
