"""Stages given as factories (what gloo/NCCL ranks use to build only their own stage), and the
configuration errors of the multi-process options, all in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import Pipeline
from engine.errors import PipelineConfigError


def _factories(S: int):
    def make(s: int):
        def build() -> nn.Module:
            torch.manual_seed(s)
            return nn.Sequential(nn.Linear(4, 4), nn.Tanh())

        return build

    return [make(s) for s in range(S)]


def _train(stages, schedule: str) -> list[torch.Tensor]:
    pipe = Pipeline(
        stages,
        schedule=schedule,
        chunks=2,
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        pipe.step(torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g))
    pipe.flush()
    return [p.detach().clone() for st in pipe.stages for p in st.module.parameters()]


@pytest.mark.parametrize("schedule", ["1f1b", "pb"])
def test_factories_equal_modules(schedule: str) -> None:
    built = [f() for f in _factories(3)]
    a = _train(_factories(3), schedule)
    b = _train(built, schedule)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_factory_must_return_a_module() -> None:
    with pytest.raises(PipelineConfigError, match="the factory of stage 1 returned int"):
        Pipeline(
            [lambda: nn.Linear(2, 2), lambda: 3],
            schedule="gpipe",
            chunks=1,
            loss_fn=nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(data_parallel=0), "data_parallel=0 must be an int >= 1"),
        (dict(timeout=0), "timeout=0 must be a positive number"),
        (dict(cuda_streams=True), "cuda_streams=True needs every stage's parameters on one CUDA"),
        (dict(transport="gloo", cuda_streams=True), "cuda_streams is for the local transport"),
        (
            dict(transport="gloo", schedule="pb", on_nonfinite="skip"),
            "on_nonfinite='skip' with schedule='pb' and transport='gloo'",
        ),
    ],
)
def test_multiprocess_option_errors(kwargs: dict, match: str) -> None:
    kw = dict(schedule="gpipe", chunks=2, loss_fn=nn.functional.mse_loss)
    kw.update(kwargs)
    with pytest.raises(PipelineConfigError, match=match):
        Pipeline(
            [nn.Linear(2, 2), nn.Linear(2, 2)],
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            **kw,
        )


def test_local_pipeline_refuses_whole_pipeline_checkpoints_only_when_distributed() -> None:
    pipe = Pipeline(
        _factories(2),
        schedule="gpipe",
        chunks=1,
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )
    assert pipe.layout is None and not pipe.config.distributed
    assert "stages" in pipe.state_dict()
