"""An exception inside a W action of an asynchronous program (engine/runtime/exec/failures.py).

A W computes a micro-batch's weight gradient after its B already sent the input gradient
upstream, so a W that raises loses that stage's partial sums only. These tests pin what the
user sees (their own exception, with a note; once a ``KeyError`` from a missing note text) and
that the pipeline stays consistent: flush, save, load and further steps work, and weight
gradients still to come keep their share of the update.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from engine import Pipeline
from engine.runtime.exec.failures import Outcome
from engine.schedule import Action, Kind, generate
from engine.schedule.ir import Schedule
from engine.testing import FaultInjector, InjectedFault


class _FailingWeight(torch.autograd.Function):
    """Identity on a weight whose backward (run only by W: B asks for the input gradient)
    raises while ``armed``."""

    armed = False

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return w.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if _FailingWeight.armed:
            _FailingWeight.armed = False
            raise RuntimeError("weight gradient failure in the user's stage")
        return g


class _Stage0(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(nn.functional.linear(x, _FailingWeight.apply(self.lin.weight), self.lin.bias))


def _program(update_size: int, w_before_update: bool) -> Schedule:
    """pb (1f1b order) with its backwards split: each W right after its B, or (to keep Bs
    waiting for their W) every W of an update group just before the group's U."""
    base = generate("pb", stages=2, chunks=2, steps=4, order="1f1b", update_size=update_size)
    actions = []
    for acts in base.actions:
        out: list[Action] = []
        for a in acts:
            if w_before_update and a.kind is Kind.UPDATE:
                out.extend(Action.weight(m) for m in a.mbs)
            out.append(a)
            if not w_before_update and a.kind is Kind.BACKWARD:
                out.append(Action.weight(a.mb))
        actions.append(tuple(out))
    return dataclasses.replace(base, name="pbw", actions=tuple(actions), ticks=None)


def _pipe(program: Schedule, **kw: Any) -> Pipeline:
    torch.manual_seed(0)
    return Pipeline(
        [_Stage0(), nn.Linear(4, 2)], schedule=program, loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **kw,
    )


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def _params(pipe: Pipeline) -> list[torch.Tensor]:
    return [p.detach().clone() for st in pipe.stages for p in st.module.parameters()]


@pytest.fixture(autouse=True)
def _disarm() -> Any:
    yield
    _FailingWeight.armed = False


def test_exception_inside_a_w_surfaces_and_the_pipeline_goes_on() -> None:
    program = _program(update_size=1, w_before_update=False)
    data = _data(4)
    pipe = _pipe(program)
    pipe.step(*data[0])
    _FailingWeight.armed = True
    with pytest.raises(RuntimeError, match="weight gradient failure in the user's stage") as info:
        pipe.step(*data[1])
    assert not isinstance(info.value.__context__, KeyError)
    (note,) = info.value.__notes__
    assert "at stage 0, W of micro-batch" in note and Outcome.WEIGHT_GRADIENT_FAILED.value in note
    pipe.flush()  # runs the rest of step 1, then drains
    stats = pipe.stats()
    assert pipe.flushed and stats["dropped_microbatches"] == 1
    assert len(set(stats["updates"])) == 1
    fresh = _pipe(program)
    fresh.load_state_dict(pipe.state_dict())
    for p in (pipe, fresh):
        p.step(*data[2])
        p.flush()
    after = _params(pipe)
    assert all(torch.equal(a, b) for a, b in zip(after, _params(fresh), strict=True))
    assert all(torch.isfinite(t).all() for t in after)


def test_a_failed_w_keeps_the_share_of_ws_still_to_come() -> None:
    """k = 2, both Ws before the U: W0 fails at stage 0, W1 still runs. Stage 0's update is
    then mb1's gradient renormalised to a full group -- exactly what dropping micro-batch 0
    (a non-finite loss with on_nonfinite="skip") gives stage 0."""
    program = _program(update_size=2, w_before_update=True)
    x, y = _data(1)[0]
    pipe = _pipe(program)
    _FailingWeight.armed = True
    raised = []
    for call in (lambda: pipe.step(x, y), pipe.flush, pipe.flush):  # W0 runs in step or flush
        try:
            call()
        except RuntimeError as exc:
            raised.append(str(exc))
    assert raised == ["weight gradient failure in the user's stage"] and pipe.flushed
    ref = _pipe(program, on_nonfinite="skip")
    bad_y = y.clone()
    bad_y[0] = float("nan")  # micro-batch 0
    ref.step(x, bad_y)
    ref.flush()
    assert pipe.stats()["skipped_updates"][0] == 0
    got, want = pipe.stages[0].module.parameters(), ref.stages[0].module.parameters()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_an_interrupt_before_a_w_pauses_and_flush_continues() -> None:
    """Between actions (FaultInjector) a W is like any other action: the step pauses before
    it and a flush gives the uninterrupted run bit for bit."""
    program = _program(update_size=1, w_before_update=False)
    data = _data(2)
    ref = _pipe(program)
    for x, y in data:
        ref.step(x, y)
    ref.flush()
    probe = _pipe(program)
    with FaultInjector(probe, at=None) as seen:
        probe.step(*data[0])
        probe.step(*data[1])
    at = [k for k, (_, kind, _) in enumerate(seen.actions) if kind == "W"][-1]
    pipe = _pipe(program)
    with FaultInjector(pipe, at=at, exc=KeyboardInterrupt), pytest.raises(KeyboardInterrupt) as info:
        pipe.step(*data[0])
        pipe.step(*data[1])
    assert Outcome.PAUSED.value in info.value.__notes__[0]
    pipe.flush()
    assert all(torch.equal(a, b) for a, b in zip(_params(pipe), _params(ref), strict=True))


def test_an_optimizer_failing_in_the_synchronous_update_phase_is_noted() -> None:
    class Failing(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            raise RuntimeError("optimizer failure")

    torch.manual_seed(0)
    stages = [nn.Linear(4, 4), nn.Linear(4, 2)]
    before = [p.detach().clone() for m in stages for p in m.parameters()]
    made: list[Any] = []  # the factory is called once per stage, in order: stage 1's fails
    pipe = Pipeline(
        stages, schedule="gpipe", chunks=2, loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: (Failing if made.append(p) or len(made) == 2 else torch.optim.SGD)(
            p, lr=0.1
        ),
    )
    with pytest.raises(RuntimeError, match="optimizer failure") as info:
        pipe.step(*_data(1)[0])
    (note,) = info.value.__notes__
    assert "at stage 1, update 0" in note and Outcome.UPDATE_PHASE_FAILED.value in note
    after = [p.detach() for m in stages for p in m.parameters()]
    assert not torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])
    # the step happened (stage 0 updated): counted, its segment closed, the next step runs
    assert pipe.steps == 1 and pipe.flushed
    with pytest.raises(RuntimeError, match="optimizer failure"):
        pipe.step(*_data(1)[0])
    assert pipe.steps == 2


def _nonfinite_rank(rank: int, port: int, queue: Any) -> None:
    import datetime
    import os

    import torch.distributed as dist

    from engine.errors import NonFiniteLossError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    try:
        torch.manual_seed(0)
        pipe = Pipeline(
            [nn.Linear(4, 4), nn.Linear(4, 2)], schedule="1f1b", chunks=2,
            loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            transport="gloo", timeout=30,
        )
        x, y = _data(1)[0]
        bad_y = y.clone()
        bad_y[0] = float("nan")
        try:
            pipe.step(x, bad_y)
            msg = "no error"
        except NonFiniteLossError as exc:
            msg = str(exc)
        pipe.step(x, y)  # the rolled-back pipeline goes on
        queue.put((rank, msg, pipe.steps))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_a_rank_words_the_nonfinite_error_as_the_local_executor() -> None:
    """rank.py raises with failures.nonfinite_message: the one text, with its rank wording."""
    import torch.multiprocessing as mp
    from distributed_support import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nonfinite_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for rank, msg, steps in got:
        assert msg.startswith("1 micro-batch(es) of this step (seen by the last stage) gave a "
                              "non-finite loss; the step was rolled back on every rank"), (rank, msg)
        assert msg.endswith("or pass on_nonfinite='skip'.")
        assert steps == 1, (rank, steps)  # the rolled-back step is not counted, as locally
