"""Gradient-norm clipping (engine/runtime/exec/clipping.py).

Synchronous schedules clip by the global norm over all stages: the weights equal
``torch.nn.utils.clip_grad_norm_`` + the optimizer step on the unpipelined model bit for bit
(a reference that accumulates the same micro-batch gradients in the same order). Asynchronous
schedules clip each stage's update group by its own norm: checked bit for bit against an
independent reference, the unclipped pipeline whose stage optimizers call torch's
``clip_grad_norm_`` on their own parameters in a step pre-hook, with every mitigation and
``skip_update``."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from distributed_support import tied_stages, token_batch
from torch import nn

import engine.optim as eo
from engine import Pipeline
from engine.errors import PipelineConfigError

D = 5


def _stages(S: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    out: list[nn.Module] = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(S - 1)]
    out.append(nn.Linear(D, 2))
    return out


def _batches(n: int, B: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, D, generator=g), torch.randn(B, 2, generator=g)) for _ in range(n)]


def _sgd(p: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize(
    "schedule,S,M,kw",
    [
        ("gpipe", 3, 4, {}),
        ("1f1b", 4, 4, {"checkpoint": "always"}),
        ("zbh1", 3, 3, {}),
        ("naive", 2, 1, {"checkpoint": "never"}),
        ("interleaved", 4, 4, {"virtual_stages": 2}),
    ],
)
def test_sync_equals_clip_grad_norm_on_the_unpipelined_model(
    schedule: str, S: int, M: int, kw: dict[str, Any], norm_type: float
) -> None:
    stages = _stages(S)
    ref = nn.Sequential(*copy.deepcopy(stages))
    max_norm = 0.05
    pipe = Pipeline(stages, schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
                    optimizer=_sgd, clip_grad_norm=max_norm, clip_norm_type=norm_type, **kw)
    ropt = _sgd(list(ref.parameters()))
    clipped = 0
    for x, y in _batches(4, 2 * M):
        pipe.step(x, y)
        ropt.zero_grad()
        for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):
            (nn.functional.mse_loss(ref(xm), ym) * (1.0 / M)).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        ropt.step()
        clipped += bool(norm > max_norm)
        got = pipe.stats()["grad_norm"]
        assert all(t is got[0] for t in got)  # one global norm, the same tensor at every stage
        assert isinstance(got[0], torch.Tensor) and torch.equal(got[0], norm)
        mine = [p for st in stages for p in st.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(mine, ref.parameters(), strict=True))
    assert clipped >= 3  # the test clips


def test_sync_clip_counts_a_tied_parameter_once() -> None:
    M, max_norm = 4, 0.2
    pipe = Pipeline(tied_stages(3), schedule="1f1b", chunks=M, loss_fn=nn.functional.cross_entropy,
                    optimizer=_sgd, clip_grad_norm=max_norm)
    ref = nn.Sequential(*tied_stages(3))
    ropt = _sgd(list(ref.parameters()))
    for t in range(3):
        x, y = token_batch(t)
        pipe.step(x, y)
        ropt.zero_grad()
        for xc, yc in zip(x.chunk(M), y.chunk(M), strict=True):
            (nn.functional.cross_entropy(ref(xc), yc) / M).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ropt.step()
        assert norm > max_norm
        torch.testing.assert_close(pipe.stats()["grad_norm"][0], norm, rtol=1e-6, atol=0)
    torch.testing.assert_close(pipe.stages[0].module.embed.weight, ref[0].embed.weight,
                               rtol=1e-6, atol=1e-6)


def _hooked(factory: Any, max_norm: float, norm_type: float) -> Any:
    """The reference: a stage optimizer that clips its own parameters before each step."""

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        opt = factory(params)
        def clip(o: Any, a: Any, k: Any) -> None:
            torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

        opt.register_step_pre_hook(clip)
        return opt

    return make


def _esgd(**kw: Any) -> Any:
    return lambda p: eo.SGD(p, lr=0.1, momentum=0.9, **kw)


ASYNC = {
    "pb": dict(schedule="pb", optimizer=_sgd),
    "pb-k2": dict(schedule="pb", update_size=2, optimizer=_esgd()),
    "pb-sc": dict(schedule="pb", optimizer=_esgd(spike_compensation=True)),
    "pb-lwp": dict(schedule="pb", optimizer=_esgd(prediction="linear"), checkpoint="never"),
    "pb-spectrain": dict(schedule="pb", weight_prediction="spectrain",
                         optimizer=_esgd(prediction="linear")),
    "pb-t2": dict(schedule="pb", optimizer=_esgd(discrepancy_correction=True)),
    "pb-t2-dc": dict(schedule="pb", optimizer=_esgd(discrepancy_correction=True,
                                                    delay_compensation=0.5)),
    "pipedream": dict(schedule="pipedream", optimizer=_esgd()),
    "pipedream-dc": dict(schedule="pipedream", optimizer=_esgd(delay_compensation=0.5)),
    "2bw": dict(schedule="2bw", optimizer=_esgd()),
}


@pytest.mark.parametrize(
    "name,skip_update",
    [(n, False) for n in sorted(ASYNC)]
    + [(n, True) for n in sorted(ASYNC) if n != "pb"],  # (torch.optim takes no found_inf)
)
def test_async_clips_each_update_group_by_its_own_norm(name: str, skip_update: bool) -> None:
    kw = dict(ASYNC[name])
    S, M, max_norm, norm_type = 3, 4, 0.02, 2.0
    factory = kw.pop("optimizer")
    extra = {"on_nonfinite": "skip_update"} if skip_update else {}
    pipe = Pipeline(_stages(S), chunks=M, loss_fn=nn.functional.mse_loss, optimizer=factory,
                    clip_grad_norm=max_norm, **kw, **extra)
    ref = Pipeline(_stages(S), chunks=M, loss_fn=nn.functional.mse_loss,
                   optimizer=_hooked(factory, max_norm, norm_type), **kw, **extra)
    for t, (x, y) in enumerate(_batches(5, 2 * M)):
        if skip_update and t == 2:
            y = y.clone()
            y[1] = float("nan")  # one micro-batch's loss is not finite: its group is skipped
        a, b = pipe.step(x, y), ref.step(x, y)
        assert torch.equal(a, b) or (a.isnan() and b.isnan())
    pipe.flush()
    ref.flush()
    for sa, sb in zip(pipe.stages, ref.stages, strict=True):
        for p, q in zip(sa.module.parameters(), sb.module.parameters(), strict=True):
            assert torch.equal(p, q), name
    stats = pipe.stats()
    norms = stats["grad_norm"]
    assert all(isinstance(n, torch.Tensor) for n in norms)
    assert len({id(n) for n in norms}) == S  # per stage
    assert stats["skipped_updates"] == ref.stats()["skipped_updates"]
    if skip_update:
        assert sum(stats["skipped_updates"]) > 0


def test_async_clip_changes_the_run() -> None:
    """A tight max_norm changes the weights (the reference test above cannot pass vacuously)."""
    outs = []
    for clip in (None, 0.01):
        pipe = Pipeline(_stages(2), schedule="pb", chunks=2, loss_fn=nn.functional.mse_loss,
                        optimizer=_sgd, clip_grad_norm=clip)
        for x, y in _batches(3, 4):
            pipe.step(x, y)
        pipe.flush()
        outs.append([p.detach().clone() for st in pipe.stages for p in st.module.parameters()])
    assert not all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


@pytest.mark.parametrize(
    "kw,word",
    [
        ({"clip_grad_norm": -1.0}, "clip_grad_norm"),
        ({"clip_grad_norm": float("inf")}, "clip_grad_norm"),
        ({"clip_grad_norm": "1"}, "clip_grad_norm"),
        ({"clip_grad_norm": True}, "clip_grad_norm"),
        ({"clip_grad_norm": 1.0, "clip_norm_type": 0}, "clip_norm_type"),
        ({"clip_grad_norm": 1.0, "clip_norm_type": "two"}, "clip_norm_type"),
    ],
)
def test_bad_clip_options_are_refused(kw: dict[str, Any], word: str) -> None:
    stages = _stages(2)
    before = [p.detach().clone() for st in stages for p in st.parameters()]
    with pytest.raises(PipelineConfigError, match=word):
        Pipeline(stages, schedule="gpipe", chunks=2, loss_fn=nn.functional.mse_loss,
                 optimizer=_sgd, **kw)
    assert all(torch.equal(a, p) for a, p in zip(before, [p for st in stages for p in st.parameters()],
                                                  strict=True))


def test_no_clipping_reports_no_norm() -> None:
    pipe = Pipeline(_stages(2), schedule="gpipe", chunks=2, loss_fn=nn.functional.mse_loss,
                    optimizer=_sgd)
    pipe.step(*_batches(1, 4)[0])
    assert pipe.stats()["grad_norm"] == [None, None]
