"""Tied parameters across stages (engine/runtime/ties.py): a token embedding whose weight is
also the output head. Synchronous schedules train it as the unpipelined tied model does, with
the holders' copies bitwise equal; asynchronous schedules refuse it with a reason; gloo equals
the local run bit for bit."""

from __future__ import annotations

import pytest
import torch
from distributed_support import spawn, tied_stages, token_batch
from schedules import ASYNC, SYNC
from torch import nn

import engine
from engine import Pipeline
from engine.errors import PipelineConfigError

M = 4


def _optimizer(p: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(p, lr=0.2, momentum=0.9, weight_decay=0.01)


def _pipe(schedule: str, S: int = 3, **kw) -> Pipeline:
    return Pipeline(tied_stages(S), schedule=schedule, chunks=M, loss_fn=nn.functional.cross_entropy,
                    optimizer=_optimizer, **kw)


def _tied_copies(pipe: Pipeline) -> tuple[torch.Tensor, torch.Tensor]:
    return pipe.stages[0].module.embed.weight, pipe.stages[-1].module.weight


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("schedule", SYNC)
def test_tied_weights_equal_the_unpipelined_tied_model(schedule: str, checkpoint: str) -> None:
    pipe = _pipe(schedule, checkpoint=checkpoint)
    ref = nn.Sequential(*tied_stages(3))
    assert ref[0].embed.weight is ref[2].weight  # the unpipelined model holds one parameter
    opt = _optimizer(list(ref.parameters()))
    for t in range(5):
        x, y = token_batch(t)
        pipe.step(x, y)
        opt.zero_grad()
        for xc, yc in zip(x.chunk(M), y.chunk(M), strict=True):
            (nn.functional.cross_entropy(ref(xc), yc) / M).backward()
        opt.step()
    a, b = _tied_copies(pipe)
    assert a is not b and torch.equal(a, b)  # two copies, the same values
    torch.testing.assert_close(a, ref[0].embed.weight, rtol=1e-6, atol=1e-6)
    body = [(st.module.body if hasattr(st.module, "body") else st.module) for st in pipe.stages[1:]]
    for mine, other in zip([p for m in body for p in m.parameters()],
                           [p for m in list(ref)[1:] for p in (m.body if hasattr(m, "body") else m).parameters()],
                           strict=True):
        torch.testing.assert_close(mine, other, rtol=1e-6, atol=1e-6)
    assert pipe.ties and pipe.ties[0].stages == [0, 2]


@pytest.mark.parametrize("schedule", ASYNC)
def test_asynchronous_schedules_refuse_ties_and_change_nothing(schedule: str) -> None:
    stages = tied_stages(3)
    before = [p.detach().clone() for m in stages for p in m.parameters()]
    with pytest.raises(PipelineConfigError, match=r"tied parameters across stages \(stage 0 'embed.weight', stage 2 'weight'\).*synchronous"):
        Pipeline(stages, schedule=schedule, chunks=M, loss_fn=nn.functional.cross_entropy,
                 optimizer=_optimizer)
    assert stages[0].embed.weight is stages[2].weight  # still tied: nothing was changed
    assert all(torch.equal(a, b) for a, b in zip(before, [p for m in stages for p in m.parameters()], strict=True))


def test_a_parameter_tied_to_a_buffer_is_refused() -> None:
    torch.manual_seed(0)
    first = nn.Linear(4, 4)
    second = nn.Linear(4, 2)
    second.register_buffer("alias", first.weight.data)
    with pytest.raises(PipelineConfigError, match=r"stage 1 buffer 'alias' shares memory with parameter 'weight' of stage 0"):
        Pipeline([first, second], schedule="gpipe", chunks=2, loss_fn=nn.functional.mse_loss,
                 optimizer=_optimizer)


def test_tied_pipeline_saves_and_loads(tmp_path) -> None:
    pipe = _pipe("1f1b")
    for t in range(2):
        pipe.step(*token_batch(t))
    engine.save(pipe, tmp_path / "ck")
    other = _pipe("1f1b")
    engine.load(other, tmp_path / "ck")
    for t in range(2, 4):
        x, y = token_batch(t)
        assert torch.equal(pipe.step(x, y), other.step(x, y))
    a, b = _tied_copies(other)
    assert torch.equal(a, b) and torch.equal(a, _tied_copies(pipe)[0])


@pytest.mark.distributed
def test_gloo_ties_equal_local_bit_for_bit() -> None:
    S = 3
    results = spawn(S, [("ties", dict(S=S))], timeout=180)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        for schedule, r in res["ties"].items():
            assert "error" not in r, r.get("error")
            assert r["weights_equal"] and r["losses_equal"], (rank, schedule)
    for schedule in ("gpipe", "1f1b"):
        first, last = results[0]["ties"][schedule]["tied"], results[-1]["ties"][schedule]["tied"]
        assert len(first) == len(last) == 1 and torch.equal(first[0], last[0])
