"""A user-written schedule program runs with the same semantics, delays and stats as its
built-in twin: ``Pipeline(schedule=<Schedule or its text>)`` lowers (adds communication),
validates and compiles it once; its last step also drains it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.schedule as sched
from engine import Pipeline, PipelineConfigError, ScheduleError

HAND_WRITTEN_1F1B = """
# PipeDream-Flush for 2 stages and 2 micro-batches, written by hand (compute only)
schedule my1f1b stages=2 chunks=2 steps=1 update_size=2 order=1f1b weights=live ticks=0
s0: F0 F1 B0 B1 U0-1
s1: F0 B0 F1 B1 U0-1
"""


def _stages(S: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(S - 1)] + [nn.Linear(3, 2)]


def _pipe(schedule, S: int, **kw) -> Pipeline:
    return Pipeline(
        _stages(S),
        schedule=schedule,
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        checkpoint="never",
        trace=True,
        **kw,
    )


def _train(pipe: Pipeline, steps: int, M: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        losses.append(pipe.step(torch.randn(2 * M, 3, generator=g), torch.randn(2 * M, 2, generator=g)))
    return losses


def _weights(pipe: Pipeline) -> list[torch.Tensor]:
    return [p.detach().clone() for st in pipe.stages for p in st.module.parameters()]


def test_hand_written_text_equals_its_builtin_twin() -> None:
    mine = _pipe(HAND_WRITTEN_1F1B, 2)
    twin = _pipe("1f1b", 2, chunks=2)
    assert mine.schedule == "my1f1b" and mine.is_sync and mine.delays == twin.delays == [0, 0]
    la, lb = _train(mine, 5, 2), _train(twin, 5, 2)
    assert all(torch.equal(a, b) for a, b in zip(la, lb, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_weights(mine), _weights(twin), strict=True))


@pytest.mark.parametrize(
    "name,S,M,T,kw",
    [
        ("gpipe", 3, 2, 2, {}),
        ("pipedream", 3, 2, 3, {}),
        ("2bw", 3, 3, 3, {}),
        ("pb", 3, 2, 3, {}),
        ("pb", 3, 2, 4, {"order": "1f1b"}),
        ("pb", 2, 2, 3, {"update_size": 2}),
    ],
)
@pytest.mark.parametrize("comms", [True, False])
def test_generated_program_equals_the_family(name: str, S: int, M: int, T: int, kw, comms) -> None:
    """``generate(...)``'s text (with or without communication) run as a program for T steps
    equals the family run for T steps and flushed: weights, losses, delays, measured delays,
    per-micro-batch records and weight versions."""
    program = sched.generate(name, stages=S, chunks=M, steps=T, **kw)
    text = sched.format_schedule(program, comms=comms, ticks=comms)
    mine = _pipe(text, S)
    twin = _pipe(name, S, chunks=M, **kw)
    assert mine.delays == list(sched.analyze(program).delays)
    la, lb = _train(mine, T, M), _train(twin, T, M)
    twin.flush()
    assert mine.flushed  # a program's last step drains it
    assert all(torch.equal(a, b) for a, b in zip(la, lb, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_weights(mine), _weights(twin), strict=True))
    sa, sb = mine.stats(), twin.stats()
    for key in ("updates", "measured_delays", "weight_versions", "activation_peak"):
        assert sa[key] == sb[key], key
    for st_a, st_b in zip(mine.stages, twin.stages, strict=True):
        assert st_a.records == st_b.records
    # and it starts over: T more steps equal the family with a flush every T steps
    _train(mine, T, M)
    _train(twin, T, M)
    twin.flush()
    assert all(torch.equal(a, b) for a, b in zip(_weights(mine), _weights(twin), strict=True))


def test_program_can_be_flushed_early() -> None:
    program = sched.generate("pb", stages=3, chunks=2, steps=4)
    mine = _pipe(program, 3)
    twin = _pipe("pb", 3, chunks=2)
    _train(mine, 2, 2)
    _train(twin, 2, 2)
    mine.flush()
    twin.flush()
    assert mine.flushed
    assert all(torch.equal(a, b) for a, b in zip(_weights(mine), _weights(twin), strict=True))


def test_broken_programs_are_refused_before_anything_runs() -> None:
    bad = HAND_WRITTEN_1F1B.replace("s1: F0 B0 F1 B1 U0-1", "s1: B0 F0 F1 B1 U0-1")
    with pytest.raises(ScheduleError, match="backward before its forward"):
        _pipe(bad, 2)
    with pytest.raises(PipelineConfigError, match="stages=3 but the program says 2"):
        Pipeline(
            _stages(3), schedule=HAND_WRITTEN_1F1B, loss_fn=nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )
    with pytest.raises(PipelineConfigError, match="chunks=4 but the program says 2"):
        _pipe(HAND_WRITTEN_1F1B, 2, chunks=4)
