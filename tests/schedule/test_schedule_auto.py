"""schedule="auto": across memory caps the chooser picks the fastest family and placement whose
predicted peak fits on every rank -- checked against an independent simulation of every
candidate -- a tight cap V-Min, a loose one a zero-bubble family; it refuses with the smallest
cap that fits; asynchronous families only with "auto-async"; the pipeline reports the choice
in stats() and trains the chosen family; the command line says it on its first line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine import Pipeline, PipelineConfigError
from engine.schedule import analyze, family, generate
from engine.schedule.analysis import rank_activation_bytes
from engine.schedule.auto import NoScheduleFits, StageCosts, candidates, choose_schedule, pick
from engine.schedule.simulate import Costs

#: 8 equal stages whose memory is their activations (1000 B per micro-batch, no weights)
EQUAL = [StageCosts(forward=1.0, backward=2.0, activation_bytes=1000)] * 8
M = 16


def _independent(costs: list[StageCosts], name: str, ranks: int, v: int | None) -> tuple[float, int]:
    """(step time, peak bytes) of one candidate, simulated here without the chooser."""
    S = len(costs)
    row = family(name)
    program = row.program_for(S, M, virtual_stages=v) if row.is_program else generate(name, S, M)
    assert program.ranks == ranks
    rep = analyze(program, Costs(forward=[c.forward for c in costs],
                                 backward=[c.backward for c in costs]))
    acts = rank_activation_bytes(program, [c.activation_bytes for c in costs])
    fixed = [sum(costs[s].fixed_bytes for s in program.rank_stages(r)) for r in range(ranks)]
    return rep.makespan, max(a + f for a, f in zip(acts, fixed, strict=True))


def test_choice_is_the_fastest_that_fits_across_caps() -> None:
    tried, _ = candidates(EQUAL, chunks=M)
    truth = {(c.family, c.ranks, c.virtual_stages): _independent(EQUAL, c.family, c.ranks,
                                                                   c.virtual_stages) for c in tried}
    for c in tried:
        assert (c.step_time, c.peak) == truth[(c.family, c.ranks, c.virtual_stages)], c
    peaks = sorted({p for _, p in truth.values()})
    for cap in [*peaks, *(p + 1 for p in peaks), peaks[-1] * 2]:
        choice = pick(tried, cap)  # what choose_schedule does after simulating the candidates
        fitting = [t for k, t in truth.items() if t[1] <= cap]
        assert choice.chosen.peak <= cap
        assert choice.chosen.step_time == min(t for t, _ in fitting), cap
    for cap in peaks[:3]:
        assert choose_schedule(EQUAL, chunks=M, memory_cap_bytes=cap) == pick(tried, cap)


def test_tight_cap_picks_vmin_loose_cap_a_zero_bubble_family() -> None:
    vmin_peak = 2 * ((4 + 4) // 3) * 1000  # 4 ranks: (R+4)//3 rank-layers of 2 V stages
    tight = choose_schedule(EQUAL, chunks=M, memory_cap_bytes=vmin_peak)
    assert tight.family == "vmin" and tight.chosen.peak == vmin_peak
    assert "vmin on 4 ranks" in tight.reason() and "faster but over the cap" in tight.reason()
    loose = choose_schedule(EQUAL, chunks=M, memory_cap_bytes=10**9)
    assert loose.family == "zbh1"  # one stage per rank on all 8
    four = choose_schedule(EQUAL, chunks=M, memory_cap_bytes=None, ranks=4)
    assert four.family == "zbv" and four.chosen.ranks == 4  # on 4 processes: the V's zero bubble
    assert choose_schedule(EQUAL, chunks=M, memory_cap_bytes=6000, ranks=4).family == "vhalf"


def test_refusal_names_the_smallest_cap_and_every_peak() -> None:
    with pytest.raises(NoScheduleFits) as err:
        choose_schedule(EQUAL, chunks=M, memory_cap_bytes=999)
    msg = str(err.value)
    assert "memory_cap_bytes=999" in msg and "smallest cap that fits is 1000 bytes (naive" in msg
    for name in ("vmin on 4 ranks", "zbh1 on 8 ranks", "1f1b on 8 ranks", "dualpipev"):
        assert name in msg
    with pytest.raises(ValueError, match="memory_cap_bytes must be a positive number"):
        choose_schedule(EQUAL, chunks=M, memory_cap_bytes=-1)


def test_asynchronous_families_only_when_asked() -> None:
    sync, _ = candidates(EQUAL, chunks=M)
    assert all(family(c.family).synchronous for c in sync)
    every, _ = candidates(EQUAL, chunks=M, asynchronous=True)
    assert {"pipedream", "2bw", "pb"} <= {c.family for c in every}
    assert {("pb", "dataflow"), ("pb", "1f1b")} <= {(c.family, c.order) for c in every}
    choice = choose_schedule(EQUAL, chunks=M, memory_cap_bytes=None, asynchronous=True)
    fastest = min(every, key=lambda c: c.step_time)
    assert choice.chosen.step_time == fastest.step_time


def _stages(S: int = 8) -> list[nn.Module]:
    """Activation-heavy stages: 8-wide layers on 64-sample micro-batches, small weights."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(S)]


def test_pipeline_reports_and_runs_the_choice(tmp_path: Path) -> None:
    x, y = torch.randn(16 * 64, 8), torch.randn(16 * 64, 8)
    kw = dict(chunks=16, loss_fn=nn.functional.mse_loss,
              optimizer=lambda p: torch.optim.SGD(p, lr=0.01), sample=x[:64])
    profile = tmp_path / "costs.json"
    loose = Pipeline(_stages(), schedule="auto", balance_profile=str(profile), **kw)
    choice = loose.stats()["schedule_choice"]
    assert choice["family"] == loose.schedule and choice["reason"].startswith("schedule auto chose")
    assert profile.exists()  # measured once; read back below: the same costs, the same choice
    peaks = sorted(t["peak"] for t in choice["tried"].values())
    tight = Pipeline(_stages(), schedule="auto", balance_profile=str(profile),
                     memory_cap_bytes=sorted(set(peaks))[1], **kw)
    c = tight.stats()["schedule_choice"]
    assert c["peak_bytes"] and max(c["peak_bytes"]) <= c["cap"]
    fit = [t for t in c["tried"].values() if t["peak"] <= c["cap"]]
    assert c["step_time"] == min(t["step_time"] for t in fit)
    ref = Pipeline(_stages(), schedule="gpipe", chunks=16, loss_fn=nn.functional.mse_loss,
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    assert torch.equal(tight.step(x, y), ref.step(x, y))  # every choice is synchronous
    assert Pipeline(_stages(), schedule="1f1b", **{k: v for k, v in kw.items() if k != "sample"}
                    ).stats()["schedule_choice"] is None


@pytest.mark.parametrize("kw, needle", [
    (dict(memory_cap_bytes=1.0), "smallest cap that fits is"),
    (dict(virtual_stages=2), "leave virtual_stages=2 unset"),
    (dict(sample=None), "pass sample=<one micro-batch of inputs>"),
    (dict(transport="gloo"), "under gloo/NCCL"),
    (dict(balance="time"), "balance='time'"),
])
def test_refusals_name_the_option(kw: dict, needle: str) -> None:
    args = dict(chunks=4, loss_fn=nn.functional.mse_loss, sample=torch.randn(4, 8),
                optimizer=lambda p: torch.optim.SGD(p, lr=0.01)) | kw
    stages = _stages(4)
    before = [p.detach().clone() for m in stages for p in m.parameters()]
    with pytest.raises(PipelineConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        Pipeline(stages, schedule="auto", **args)
    assert all(torch.equal(a, b) for a, b in zip(before, [p for m in stages for p in m.parameters()],
                                                  strict=True))


def test_unknown_name_lists_every_family_and_the_choosers() -> None:
    from engine.schedule.catalog import NAMES

    with pytest.raises(PipelineConfigError) as err:
        Pipeline(_stages(4), schedule="zvb", chunks=4, loss_fn=nn.functional.mse_loss,
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    assert str(err.value) == (f"unknown schedule 'zvb'; known schedules: {', '.join(NAMES)} "
                              "(or 'auto', 'auto-async'); did you mean 'zbv'?")
    assert len(NAMES) == 13


def test_cli_first_line_says_what_auto_chose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.__main__ import main

    argv = ["train", "--layers", "4", "--width", "16", "--stages", "4", "--chunks", "4",
            "--epochs", "1", "--out", str(tmp_path), "--schedule", "auto", "--memory-cap", "1e9"]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("schedule auto chose ") and "cap 953.7 MiB" in first
    assert (tmp_path / "stage_costs.json").exists()
    assert main([*argv[:-2], "--memory-cap", "10", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "smallest cap that fits is" in err and "Traceback" not in err
    assert main(["train", "--schedule", "vmin", "--memory-cap", "5"]) == 2
    assert "--memory-cap applies to --schedule auto only" in capsys.readouterr().err
