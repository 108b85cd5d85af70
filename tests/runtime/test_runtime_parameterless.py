"""Stages without parameters (an activation, a reshape, a pooling layer cut out on its own):
they hold no weights, so they keep no versions and run no optimizer, but they still count
their updates, so the schedule's bookkeeping (versions, delays) stays that of S stages."""

from __future__ import annotations

import pytest
import torch
from schedules import ALL, SYNC
from torch import nn

import engine
from engine import Pipeline

SCHEDULES = list(ALL)


def _model(split_relu: bool) -> list[nn.Module]:
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 1)
    if split_relu:
        return [first, nn.ReLU(), last]
    return [nn.Sequential(first, nn.ReLU()), last]


def _pipe(stages: list[nn.Module], schedule: str) -> Pipeline:
    return Pipeline(
        stages, schedule=schedule, chunks=3, loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    )


def _data(steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("schedule", SYNC)
def test_a_parameterless_stage_changes_nothing_synchronously(schedule: str) -> None:
    """Synchronous schedules: the ReLU as its own stage trains exactly as the ReLU inside the
    first stage."""
    split, folded = _pipe(_model(True), schedule), _pipe(_model(False), schedule)
    for x, y in _data():
        assert torch.equal(split.step(x, y), folded.step(x, y))
    a = [p for st in split.stages for p in st.module.parameters()]
    b = [p for st in folded.stages for p in st.module.parameters()]
    assert len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_runs_saves_and_loads_with_a_parameterless_stage(schedule: str, tmp_path) -> None:
    pipe = _pipe(_model(True), schedule)
    for x, y in _data():
        loss = pipe.step(x, y)
        assert torch.isfinite(loss)
    pipe.flush()
    stats = pipe.stats()
    assert stats["skipped_updates"][1] == 0  # no optimizer there, and nothing was skipped
    assert stats["weight_buffers"][1] == 1
    # the parameterless stage counts updates like its neighbours: its delays are the schedule's
    assert max(stats["measured_delays"][1]) == pipe.delays[1]
    engine.save(pipe, tmp_path / "ck")
    other = _pipe(_model(True), schedule)
    engine.load(other, tmp_path / "ck")
    for st_a, st_b in zip(pipe.stages, other.stages, strict=True):
        for p, q in zip(st_a.module.parameters(), st_b.module.parameters(), strict=True):
            assert torch.equal(p, q)
    x, y = _data(1)[0]
    assert torch.isfinite(other.step(x, y))
