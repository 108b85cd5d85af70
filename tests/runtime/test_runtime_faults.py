"""Exceptions inside step() and flush() leave every stage consistent (engine/runtime/exec/executor.py).

A failure is injected before every action index of a step, for every schedule:

* synchronous schedules roll the step back -- weights, optimizer state, RNG state and module
  buffers are what they were -- and retrying the step gives the uninterrupted run bit for bit;
* asynchronous schedules pause before the action; ``flush()`` runs the rest of the step and
  drains, which gives the uninterrupted run (same steps, then a flush) bit for bit;

and in both cases save + load into a fresh pipeline + further steps equal the uninterrupted
pipeline. A KeyboardInterrupt behaves the same way. Exceptions raised *inside* a stage (the
user's module, the loss) drop that micro-batch (asynchronous) or roll back (synchronous).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from schedules import ASYNC, SYNC
from torch import nn

import engine.optim as eo
from engine import Pipeline
from engine.errors import NonFiniteLossError, PipelineInputError
from engine.testing import FaultInjector, InjectedFault

S, M = 3, 2
SCHEDULES = {
    "naive": {},
    "gpipe": {},
    "1f1b": {},
    "zbh1": {},
    "pipedream": {},
    "2bw": {},
    "pb": {},
    "pb-1f1b": {"order": "1f1b"},
    "pb-lwp": {"opt": {"prediction": "linear"}, "checkpoint": "never"},
    "pb-t2": {"opt": {"discrepancy_correction": True}, "checkpoint": "always"},
}


def _stages(dropout: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for s in range(S):
        layers: list[nn.Module] = [nn.Linear(4, 4 if s < S - 1 else 2)]
        if s < S - 1:
            layers.append(nn.Tanh())
            if dropout and s == 1:
                layers.append(nn.Dropout(0.3))
        out.append(nn.Sequential(*layers))
    return out


def _pipe(name: str, **extra: Any) -> Pipeline:
    kw = dict(SCHEDULES[name])
    opt_kw = kw.pop("opt", {})
    schedule = name.split("-")[0]
    M_ = max(M, S) if schedule == "2bw" else M
    return Pipeline(
        _stages(extra.pop("dropout", False)),
        schedule=schedule,
        chunks=M_,
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: eo.SGD(p, lr=0.05, momentum=0.9, **opt_kw),
        **{"checkpoint": "except_last", **kw, **extra},
    )


def _batches(n: int, chunks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(2 * chunks, 4, generator=g), torch.randn(2 * chunks, 2, generator=g))
        for _ in range(n)
    ]


def _state(pipe: Pipeline) -> list[torch.Tensor]:
    out = [t.detach().clone() for st in pipe.stages for t in st.module.state_dict().values()]
    for st in pipe.stages:
        for s in st.optimizer.state.values():
            out += [v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _count_actions(name: str, warm: int) -> int:
    pipe = _pipe(name)
    data = _batches(warm + 1, pipe.chunks)
    for x, y in data[:warm]:
        pipe.step(x, y)
    with FaultInjector(pipe, at=None) as faults:
        pipe.step(*data[warm])
    return len(faults.actions)


WARM = 2


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("fault", ["injected", "interrupt"])
def test_failure_before_every_action_leaves_a_consistent_pipeline(name: str, fault: str) -> None:
    exc: type[BaseException] = InjectedFault if fault == "injected" else KeyboardInterrupt
    count = _count_actions(name, WARM)
    assert count > 3 * S
    ref = _pipe(name)
    data = _batches(WARM + 3, ref.chunks)
    for x, y in data[: WARM + 1]:
        ref.step(x, y)
    ref.flush()
    ref_after_step = _state(ref)
    ref_rng = torch.get_rng_state()
    for x, y in data[WARM + 1 :]:
        ref.step(x, y)
    ref.flush()
    ref_final = _state(ref)
    indices = range(count) if fault == "injected" else range(0, count, 3)
    for at in indices:
        pipe = _pipe(name)
        for x, y in data[:WARM]:
            pipe.step(x, y)
        before = _state(pipe)
        rng = torch.get_rng_state()
        with FaultInjector(pipe, at=at, exc=exc) as faults:
            with pytest.raises(exc) as info:
                pipe.step(*data[WARM])
        assert faults.fired
        assert any("engine.Pipeline" in n for n in getattr(info.value, "__notes__", []))
        if name in SYNC:
            assert _same(before, _state(pipe)), f"{name}: step not rolled back (fault at {at})"
            assert torch.equal(torch.get_rng_state(), rng)
            assert pipe.flushed and pipe.steps == WARM
            pipe.step(*data[WARM])  # the retry
        else:
            assert not pipe.flushed  # paused inside the step
        pipe.flush()
        assert pipe.flushed
        assert _same(_state(pipe), ref_after_step), f"{name}: fault at {at} changed the run"
        # save + load into a fresh pipeline + continue == the uninterrupted pipeline
        state = pipe.state_dict()
        fresh = _pipe(name)
        fresh.load_state_dict(copy.deepcopy(state))
        for p in (pipe, fresh):
            torch.set_rng_state(ref_rng)
            for x, y in data[WARM + 1 :]:
                p.step(x, y)
            p.flush()
            assert _same(_state(p), ref_final), f"{name}: fault at {at}, continuing differs"


class _RaiseOn(nn.Module):
    """Wraps a stage: raises inside its forward (or its backward) when the stage's input
    holds the marked sample (first feature 123)."""

    def __init__(self, where: str, inner: nn.Module) -> None:
        super().__init__()
        self.where = where
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marked = bool((x[:, 0] == 123.0).any())
        if marked and self.where == "F":
            raise RuntimeError("stage failure on the marked sample")
        y = self.inner(x)
        if marked and self.where == "B":
            return _FailInBackward.apply(y)
        return y


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("backward failure on the marked sample")


def _marked_pipe(schedule: str, where: str, **kw: Any) -> Pipeline:
    stages = _stages()
    stages[0] = _RaiseOn(where, stages[0])
    return Pipeline(
        stages,
        schedule=schedule,
        chunks=M,
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        checkpoint="never",
        **kw,
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("where", ["F", "B"])
def test_exception_inside_a_synchronous_stage_rolls_back(schedule: str, where: str) -> None:
    pipe = _marked_pipe(schedule, where)
    data = _batches(3, M)
    pipe.step(*data[0])
    before = _state(pipe)
    bad_x = data[1][0].clone()
    bad_x[1, 0] = 123.0
    with pytest.raises(RuntimeError, match="failure on the marked sample") as info:
        pipe.step(bad_x, data[1][1])
    assert any("rolled back" in n for n in info.value.__notes__)
    assert _same(before, _state(pipe)) and pipe.steps == 1
    pipe.step(*data[2])
    ref = _marked_pipe(schedule, where)
    ref.step(*data[0])
    ref.step(*data[2])
    assert _same(_state(pipe), _state(ref))


@pytest.mark.parametrize("schedule", ["pipedream", "pb"])
def test_exception_inside_an_asynchronous_forward_drops_that_microbatch(schedule: str) -> None:
    """Equivalent to a run where that micro-batch's loss was non-finite and skipped: its
    gradient reaches no update, every other micro-batch's does."""
    data = _batches(4, M)
    bad_x = data[1][0].clone()
    bad_x[2, 0] = 123.0  # micro-batch 1 of step 1 (global micro-batch 3)
    pipe = _marked_pipe(schedule, "F")
    pipe.step(*data[0])
    with pytest.raises(RuntimeError, match="failure on the marked sample") as info:
        pipe.step(bad_x, data[1][1])
    assert any("dropped at every stage" in n for n in info.value.__notes__)
    for x, y in data[2:]:
        pipe.step(x, y)
    pipe.flush()
    ref = _marked_pipe(schedule, "none", on_nonfinite="skip")
    bad_y = data[1][1].clone()
    bad_y[2] = float("nan")
    ref.step(*data[0])
    ref.step(bad_x, bad_y)
    for x, y in data[2:]:
        ref.step(x, y)
    ref.flush()
    assert pipe.stats()["dropped_microbatches"] == 1 == ref.stats()["dropped_microbatches"]
    assert _same(_state(pipe), _state(ref))


@pytest.mark.parametrize("schedule", ASYNC)
def test_exception_inside_an_asynchronous_backward_keeps_the_pipeline_usable(
    schedule: str,
) -> None:
    data = _batches(5, max(M, S) if schedule == "2bw" else M)
    chunks = max(M, S) if schedule == "2bw" else M
    pipe = Pipeline(
        _stages_with_marker(), schedule=schedule, chunks=chunks, loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05), checkpoint="never",
    )
    bad_x = data[1][0].clone()
    bad_x[0, 0] = 123.0
    pipe.step(*data[0])
    raised = 0
    for x, y in [(bad_x, data[1][1]), *data[2:]]:
        try:
            pipe.step(x, y)
        except RuntimeError as exc:
            assert "backward failure" in str(exc)
            assert any("discarded" in n for n in exc.__notes__)
            raised += 1
    try:
        pipe.flush()
    except RuntimeError:
        raised += 1
        pipe.flush()
    assert raised == 1 and pipe.flushed
    st = pipe.stats()
    assert len(set(st["updates"])) == 1 and st["dropped_microbatches"] >= 1
    fresh = Pipeline(
        _stages_with_marker(), schedule=schedule, chunks=chunks,
        loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        checkpoint="never",
    )
    fresh.load_state_dict(pipe.state_dict())
    for p in (pipe, fresh):
        p.step(*data[-1])
        p.flush()
    assert _same(_state(pipe), _state(fresh))
    for stage in pipe.stages:
        assert all(torch.isfinite(t).all() for t in stage.module.parameters())


def _stages_with_marker() -> list[nn.Module]:
    stages = _stages()
    stages[0] = _RaiseOn("B", stages[0])
    return stages


def test_rollback_restores_rng_and_buffers() -> None:
    """Dropout draws and BatchNorm statistics of a failed synchronous step are undone."""

    def stages() -> list[nn.Module]:
        torch.manual_seed(0)
        return [
            nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)),
            nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
            nn.Linear(4, 2),
        ]

    def pipe() -> Pipeline:
        return Pipeline(
            stages(), schedule="1f1b", chunks=M, loss_fn=nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05), checkpoint="always",
        )

    data = _batches(3, M)
    a, b = pipe(), pipe()
    torch.manual_seed(11)
    a.step(*data[0])
    before = _state(a)
    rng = torch.get_rng_state()
    with FaultInjector(a, at=7), pytest.raises(InjectedFault):
        a.step(*data[1])
    assert torch.equal(torch.get_rng_state(), rng)
    assert _same(before, _state(a))  # BatchNorm's running stats included
    a.step(*data[1])
    torch.manual_seed(11)
    b.step(*data[0])
    b.step(*data[1])
    assert _same(_state(a), _state(b))


def test_nonfinite_raise_then_flush_and_continue_async() -> None:
    pipe = _pipe("pb")
    data = _batches(4, M)
    bad_y = data[1][1].clone()
    bad_y[0] = float("nan")
    pipe.step(*data[0])
    with pytest.raises(NonFiniteLossError):
        pipe.step(data[1][0], bad_y)
    pipe.step(*data[2])  # the rest of step 1 runs first, then step 2
    pipe.flush()
    assert pipe.flushed and len(set(pipe.stats()["updates"])) == 1


def test_input_checks_are_keyed_by_dtype_as_well() -> None:
    """After a good step with class indices, float targets of another shape are refused by
    the dry run (nothing changes) instead of failing in the middle of the step."""
    pipe = Pipeline(
        _stages(), schedule="pb", chunks=M, loss_fn=nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
    )
    x = torch.randn(4, 4)
    pipe.step(x, torch.randint(0, 2, (4,)))
    before = _state(pipe)
    with pytest.raises(PipelineInputError, match="loss_fn cannot compare"):
        pipe.step(x, torch.rand(4, 3))
    with pytest.raises(PipelineInputError, match="stage 0"):
        pipe.step(x.double(), torch.randint(0, 2, (4,)))
    assert _same(before, _state(pipe))
