"""bench/pipeline_capture_gpu.py's logic on the CPU (a recording twin stands in for the
graph, the recording stream backend for stage streams; tiny sizes): every pair of both
schedules and both models is measured, every captured side replays, the engine and the loop
do the same math, and a case whose capture falls back to eager fails the run."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.runtime.capture.synchronous import use_backend
from engine.runtime.capture.graph_twin import RecordingTwin

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import pipeline_capture_gpu as bench  # noqa: E402

CPU = torch.device("cpu")
DENSE = bench.Dense(width=8, depth=3, batch=8, chunks=2)
TRANSFORMER = bench.Transformer(d_model=8, nhead=2, ffn=16, depth=3, batch=4, seq=3, chunks=2)
PAIRS = [("engine captured", "plain loop eager"), ("engine eager", "plain loop eager"),
         ("engine captured", "engine eager"),  # the first version's rows, names unchanged
         ("engine captured, stage streams", "plain loop eager"),
         ("engine captured, stage streams", "engine captured")]


def quick(models, twin) -> tuple[list, list[int]]:
    done: list[int] = []
    with use_backend(twin):
        rows = bench.run(CPU, models=models, rounds=1, warmup=0, min_time=0.0, log=lambda _: None,
                         done=lambda rows: done.append(len(rows)))
    return rows, done


@pytest.mark.parametrize("model", [DENSE, pytest.param(TRANSFORMER, marks=pytest.mark.slow)],
                         ids=["dense", "transformer"])
def test_every_pair_runs_and_every_captured_side_replays(model) -> None:
    twin = RecordingTwin()
    rows, done = quick([model], twin)
    assert [(r.candidate, r.peer) for r in rows] == PAIRS * 2
    assert [(r.extra["model"], r.extra["schedule"]) for r in rows[::5]] == [
        (model.name, "1f1b"), (model.name, "gpipe")]
    if model is DENSE:  # the first version's case names (a results history reads them)
        assert {r.case for r in rows} == {"1f1b 3x Linear(8) batch 8 M=2 CPU check",
                                          "gpipe 3x Linear(8) batch 8 M=2 CPU check"}
    else:
        assert rows[0].case == ("1f1b 3x TransformerEncoderLayer(8, nhead=2, ff=16) batch 4x3 "
                                "M=2 CPU check")
    assert {r.extra["goal_vs_captured_loop"] for r in rows} == {model.goal}
    assert done == [10]  # the CLI rewrites its CSV after each model
    # two captured sides (one stream, stage streams) per schedule, all replaying
    assert twin.captures == 4 and twin.replays > 4
    assert all(r.median_ratio > 0 for r in rows)


def test_the_rows_so_far_are_handed_on_after_each_model(monkeypatch) -> None:
    """What lets a run stopped at its budget keep the models it finished (the CLI rewrites
    its CSV from these)."""
    monkeypatch.setattr(bench, "SCHEDULES", ("gpipe",))
    small = bench.Dense(width=4, depth=2, batch=4, chunks=2)
    rows, done = quick([DENSE, small], RecordingTwin())
    assert done == [5, 10] and len(rows) == 10
    assert rows[5].case == "gpipe 2x Linear(4) batch 4 M=2 CPU check"


def test_the_stage_streams_side_has_separate_streams_and_hands_off_with_events() -> None:
    twin = RecordingTwin()
    with use_backend(twin):
        one = bench.pipeline(TRANSFORMER, "1f1b", "program", CPU)
        pipe = bench.pipeline(TRANSFORMER, "1f1b", "program", CPU, streams=True)
        x = torch.randn(*TRANSFORMER.shape())
        for _ in range(4):
            pipe.step(x, x)
            one.step(x, x)
    assert not one.parts.streams.separate and pipe.parts.streams.separate
    counts = pipe.parts.streams.backend.counts
    assert counts["event_wait"] > 0 and counts["event_query"] == 0
    assert pipe.stats()["capture"]["replays"] >= 1


@pytest.mark.parametrize("model", [DENSE, TRANSFORMER], ids=["dense", "transformer"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_engine_and_the_loop_take_the_same_step(model, schedule: str) -> None:
    """Same loss, same scaling by 1/M, same optimizer: two steps leave the same weights (up to
    rounding order), so the timed ratios price the runtime, not different math."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(*model.shape(), generator=g), torch.randn(*model.shape(), generator=g)
    pipe = bench.pipeline(model, schedule, False, CPU)
    net = nn.Sequential(*model.layers())
    start = [p.detach().clone() for p in net.parameters()]
    loop = bench.GraphedLoop(net, x, y, model.chunks)
    for _ in range(2):
        pipe.step(x, y)
        loop(x, y)
    engine_params = [p for st in pipe.stages for p in st.module.parameters()]
    assert len(engine_params) == len(start)
    for a, b, s in zip(engine_params, net.parameters(), start, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(b, s) for b, s in zip(net.parameters(), start, strict=True))


class HostRead(nn.Module):
    """Reads a value back on the host: a step with it is never captured."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.abs().max().item() > 1e30 else x


@dataclass(frozen=True)
class HostReadingTransformer(bench.Transformer):
    def layers(self) -> list[nn.Module]:
        return [nn.Sequential(HostRead(), layer) for layer in super().layers()]


def test_a_case_that_is_not_replayed_fails_the_run() -> None:
    broken = HostReadingTransformer(d_model=8, nhead=2, ffn=16, depth=2, batch=4, seq=3, chunks=2)
    with pytest.raises(AssertionError,
                       match="transformer 1f1b captured: not replaying.*reads the host"):
        quick([broken], RecordingTwin())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CLI measures on a GPU")
def test_cli_without_a_gpu_writes_nothing(tmp_path: Path, capsys) -> None:
    assert bench.main(["--out", str(tmp_path), "--models", "transformer", "dense"]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_cli_refuses_an_unknown_model(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--models", "mlp"])
    assert exc.value.code == 2
    assert "invalid choice: 'mlp'" in capsys.readouterr().err


TINY_CUDA = [bench.Dense(width=64, depth=3, batch=16, chunks=2),
             bench.Transformer(d_model=64, nhead=4, ffn=128, depth=3, batch=8, seq=16, chunks=2)]


@pytest.mark.cuda
def test_cuda_every_side_of_both_models_replays() -> None:
    """The benchmark's GPU path at tiny sizes, before the benchmark phase: CUDA graphs for
    both engine sides (real stage streams on one) and the loop, every pair of both models."""
    rows = bench.run(torch.device("cuda"), models=TINY_CUDA, rounds=1, warmup=0, min_time=0.0,
                     log=lambda _: None)
    loop = "plain loop captured"
    assert [(r.candidate, r.peer) for r in rows] == [
        (c, loop if p == "plain loop eager" else p) for c, p in PAIRS] * 4
    assert [r.case for r in rows[::5]] == [
        m.case(s, "one GPU") for m in TINY_CUDA for s in ("1f1b", "gpipe")]


@pytest.mark.cuda
@pytest.mark.parametrize("model", TINY_CUDA, ids=["dense", "transformer"])
def test_cuda_a_replay_of_the_captured_loop_is_an_eager_loop_step(model) -> None:
    """The peer every ratio is taken against: one replay of the captured loop trains as an
    eager step of the same loop from the same weights and momentum (its warm-up at capture
    trains too, so compare from there)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    x, y = (torch.randn(*model.shape(), generator=g, device=dev) for _ in range(2))
    net = nn.Sequential(*model.layers()).to(dev)
    loop = bench.GraphedLoop(net, x, y, model.chunks)
    torch.cuda.synchronize()
    ref = nn.Sequential(*model.layers()).to(dev)
    ref.load_state_dict(net.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=bench.LR, momentum=bench.MOMENTUM)
    opt.load_state_dict(copy.deepcopy(loop.opt.state_dict()))  # (no shared momentum)
    x2, y2 = (torch.randn(*model.shape(), generator=g, device=dev) for _ in range(2))
    loop(x2, y2)
    for xm, ym in zip(x2.chunk(model.chunks), y2.chunk(model.chunks), strict=True):
        (torch.nn.functional.mse_loss(ref(xm), ym) / model.chunks).backward()
    opt.step()
    torch.cuda.synchronize()
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_pb_pairs_run_and_the_engine_replays() -> None:
    """bench/pipeline_pb_capture_gpu.py on the CPU: a tape twin stands in for the graph (the
    reference optimizer path, which the tape can replay), tiny sizes."""
    import pipeline_pb_capture_gpu as pb

    from engine.runtime.capture.audit import _reference_optimizer
    from engine.runtime.capture.graph_twin import TapeTwin

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
