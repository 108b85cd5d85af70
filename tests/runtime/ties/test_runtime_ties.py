"""Tied parameters across stages (engine/runtime/ties/groups.py): a token embedding whose weight is
also the output head. Synchronous schedules train it as the unpipelined tied model does, with
the holders' copies bitwise equal, also when the head holds the embedding *module*;
asynchronous schedules carry the owner's value (tests/runtime/ties/test_runtime_ties_async.py); gloo equals
the local run bit for bit."""

from __future__ import annotations

import pytest
import torch
from distributed_support import spawn, tied_stages, token_batch
from schedules import ASYNC, SYNC
from ties_support import module_tied_stages
from torch import nn

import engine
from engine import Pipeline
from engine.errors import PipelineConfigError

M = 4


def _optimizer(p: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(p, lr=0.2, momentum=0.9, weight_decay=0.01)


def _pipe(schedule: str, S: int = 3, stages: list[nn.Module] | None = None, **kw) -> Pipeline:
    return Pipeline(stages or tied_stages(S), schedule=schedule, chunks=M, loss_fn=nn.functional.cross_entropy,
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


@pytest.mark.parametrize("schedule", SYNC)
def test_a_shared_module_is_the_same_tie(schedule: str) -> None:
    """The head holds the embedding *module* and reads its weight: trained as the shared
    parameter (bit for bit) and as the unpipelined model with that shared module."""
    stages = module_tied_stages(3)
    assert stages[2].emb is stages[0].embed
    pipe = _pipe(schedule, stages=stages)
    base = _pipe(schedule)
    ref = nn.Sequential(*module_tied_stages(3))
    opt = _optimizer(list(ref.parameters()))
    for t in range(5):
        x, y = token_batch(t)
        assert torch.equal(pipe.step(x, y), base.step(x, y))
        opt.zero_grad()
        for xc, yc in zip(x.chunk(M), y.chunk(M), strict=True):
            (nn.functional.cross_entropy(ref(xc), yc) / M).backward()
        opt.step()
    assert [g.holders for g in pipe.ties] == [[(0, "embed.weight"), (2, "emb.weight")]]
    assert pipe.stages[2].module.emb is not pipe.stages[0].module.embed  # its own structure
    for a, b in zip(pipe.stages, base.stages, strict=True):
        mine = {n.replace("emb.weight", "weight"): p for n, p in a.module.named_parameters()}
        theirs = dict(b.module.named_parameters())
        assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[n], theirs[n]) for n in mine)
    torch.testing.assert_close(pipe.stages[0].module.embed.weight, ref[0].embed.weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pipe.stages[2].module.emb.weight, ref[0].embed.weight, rtol=1e-6, atol=1e-6)


def test_a_shared_module_without_parameters_is_no_tie() -> None:
    """One activation module object used by two stages (a common way to write a model):
    each stage gets its own, nothing is tied, training is the unshared model's."""
    torch.manual_seed(0)
    act = nn.Tanh()
    a = [nn.Sequential(nn.Linear(4, 4), act), nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 1))]
    b = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))]
    for m, n in zip(a, b, strict=True):
        n.load_state_dict(m.state_dict())
    kw = dict(schedule="pipedream", chunks=2, loss_fn=nn.functional.mse_loss, optimizer=_optimizer)
    pa, pb_ = Pipeline(a, **kw), Pipeline(b, **kw)
    assert pa.ties == []
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
        assert torch.equal(pa.step(x, y), pb_.step(x, y))


def test_shared_modules_that_cannot_be_one_tie_are_refused() -> None:
    kw = dict(schedule="gpipe", chunks=2, loss_fn=nn.functional.mse_loss, optimizer=_optimizer)
    lin = nn.Linear(4, 4)
    with pytest.raises(PipelineConfigError, match=r"stage 1 is the module of stage 0 \(Linear\)"):
        Pipeline([lin, lin], **kw)
    bn = nn.BatchNorm1d(4)
    first, second = nn.Sequential(nn.Linear(4, 4), bn), nn.Sequential(bn, nn.Linear(4, 1))
    with pytest.raises(PipelineConfigError, match=r"stage 1 \(Sequential.0\) and stage 0 share the module BatchNorm1d"):
        Pipeline([first, second], **kw)
    assert second[0] is bn  # nothing changed


@pytest.mark.parametrize("schedule", ASYNC)
def test_asynchronous_schedules_carry_the_tie(schedule: str) -> None:
    """The head's parameter leaves its module: the owner's value is carried to it
    (tests/runtime/ties/test_runtime_ties_async.py checks the numbers)."""
    stages = tied_stages(3)
    pipe = Pipeline(stages, schedule=schedule, chunks=M, loss_fn=nn.functional.cross_entropy,
                    optimizer=_optimizer)
    assert pipe.ties[0].carried and pipe.ties[0].holders == [(0, "embed.weight"), (2, "weight")]
    assert "weight" not in dict(stages[2].named_parameters())
    pipe.step(*token_batch(0))
    out = pipe.evaluate(token_batch(1)[0])
    assert out.shape == (8, 11) and torch.isfinite(out).all()


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
