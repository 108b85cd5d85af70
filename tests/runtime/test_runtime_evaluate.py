"""Pipeline.evaluate: forward only, eval mode, live weights, and training unaffected."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_support import spawn
from torch import nn

from engine import Pipeline
from engine.errors import PipelineInputError

M = 4


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Tanh()),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
        nn.Linear(8, 2),
    ]


def _pipe(schedule: str, stages=None) -> Pipeline:
    return Pipeline(stages or _stages(), schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream", "2bw", "pb"])
def test_evaluate_mid_run_changes_nothing(schedule: str) -> None:
    """Called between steps of a pipeline with micro-batches in flight, evaluate returns the
    live-weight eval-mode outputs, and the run continues exactly as one without it."""
    with_eval, without = _pipe(schedule), _pipe(schedule)
    x_eval = torch.randn(6, 4)
    for t, (x, y) in enumerate(_data(5)):
        torch.manual_seed(t)  # dropout: both runs draw the same masks
        a = with_eval.step(x, y)
        torch.manual_seed(t)
        b = without.step(x, y)
        assert torch.equal(a, b), t
        if t in (1, 3):
            rng = torch.get_rng_state()
            out = with_eval.evaluate(x_eval)
            assert torch.equal(torch.get_rng_state(), rng)
            assert not out.requires_grad and out.shape == (6, 2)
            model = nn.Sequential(*[copy.deepcopy(st.module) for st in with_eval.stages]).eval()
            with torch.no_grad():
                expect = torch.cat([model(c) for c in x_eval.chunk(M)])
            assert torch.equal(out, expect)  # live weights, eval mode, same micro-batches
            assert all(st.module.training for st in with_eval.stages)  # modes restored
    torch.manual_seed(9)
    with_eval.flush()
    torch.manual_seed(9)
    without.flush()
    for sa, sb in zip(with_eval.stages, without.stages, strict=True):
        for (name, pa), pb in zip(sa.module.state_dict().items(), sb.module.state_dict().values(), strict=True):
            assert torch.equal(pa, pb), name


def test_evaluate_bad_input() -> None:
    pipe = _pipe("1f1b")
    with pytest.raises(PipelineInputError, match="empty batch"):
        pipe.evaluate(torch.randn(0, 4))
    with pytest.raises(PipelineInputError, match="chunks=0 is invalid"):
        pipe.evaluate(torch.randn(4, 4), chunks=0)


@pytest.mark.distributed
def test_evaluate_under_gloo_equals_local() -> None:
    results = spawn(3, [("evaluate", dict(S=3))], timeout=180)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        r = res["evaluate"]
        assert "error" not in r, r.get("error")
        assert r["outputs_equal"] and r["weights_equal"], rank


def test_evaluate_takes_tree_valued_stages() -> None:
    """Inputs and stage outputs that are tuples: each stage gets module(*out)."""

    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.lin(x), (x > 0).long()

    class Join(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.lin(h * mask)

    torch.manual_seed(0)
    pipe = Pipeline([Split(), Join()], schedule="1f1b", chunks=2, loss_fn=nn.functional.mse_loss,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    x = torch.randn(6, 4)
    out = pipe.evaluate(x)
    with torch.no_grad():
        expect = torch.cat([pipe.stages[1].module(*pipe.stages[0].module(c)) for c in x.chunk(2)])
    assert torch.equal(out, expect)
