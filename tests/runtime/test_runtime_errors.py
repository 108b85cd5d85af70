"""Bad input gets a clear error that names the culprit and teaches the fix, and changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from schedules import ASYNC, SYNC
from torch import nn

import engine.optim as optim
from engine import Pipeline
from engine.errors import NonFiniteLossError, PipelineConfigError, PipelineInputError

mse = nn.functional.mse_loss


def sgd(p):
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


def _stages(S: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(S - 1)]
    return out + [nn.Linear(4, 1)]


def _snapshot(pipe: Pipeline) -> list[torch.Tensor]:
    out = [t.detach().clone() for st in pipe.stages for t in st.module.state_dict().values()]
    for st in pipe.stages:
        for s in st.optimizer.state.values():
            out += [v.clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=False))


def test_batch_not_divisible_into_chunks() -> None:
    pipe = Pipeline(_stages(), schedule="gpipe", chunks=4, loss_fn=mse, optimizer=sgd)
    pipe.step(torch.randn(8, 4), torch.randn(8, 1))
    before = _snapshot(pipe)
    with pytest.raises(
        PipelineInputError,
        match=r"batch of 10 samples cannot be split into chunks=4.*divisible by 4",
    ):
        pipe.step(torch.randn(10, 4), torch.randn(10, 1))
    with pytest.raises(PipelineInputError, match="targets have shape"):
        pipe.step(torch.randn(8, 4), torch.randn(6, 1))
    assert _same(before, _snapshot(pipe)) and pipe.steps == 1


def test_more_stages_than_layers() -> None:
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    with pytest.raises(PipelineConfigError, match=r"balance \[1, 1, 1, 1\] covers 4 layers but there are 3"):
        Pipeline(seq, balance=[1, 1, 1, 1], schedule="gpipe", chunks=2, loss_fn=mse, optimizer=sgd)
    with pytest.raises(PipelineConfigError, match="covers 2 layers but there are 3"):
        Pipeline(seq, balance=[1, 1], schedule="gpipe", chunks=2, loss_fn=mse, optimizer=sgd)
    with pytest.raises(PipelineConfigError, match="stage 1 needs at least one of the 3 layers"):
        Pipeline(seq, balance=[2, 0, 1], schedule="gpipe", chunks=2, loss_fn=mse, optimizer=sgd)
    with pytest.raises(PipelineConfigError, match="more stages than layers"):
        Pipeline(
            [nn.Linear(4, 1), nn.Sequential()],
            schedule="gpipe",
            chunks=2,
            loss_fn=mse,
            optimizer=sgd,
        )


@pytest.mark.parametrize("schedule", ["1f1b", "pb"])
def test_stage_shape_mismatch_names_both_stages(schedule: str) -> None:
    stages = [nn.Sequential(nn.Linear(4, 5), nn.Tanh()), nn.Sequential(nn.Linear(6, 1))]
    pipe = Pipeline(stages, schedule=schedule, chunks=2, loss_fn=mse, optimizer=sgd)
    before = _snapshot(pipe)
    with pytest.raises(
        PipelineInputError, match=r"stage 0 outputs shape \(2, 5\) but stage 1 .*in_features=6"
    ):
        pipe.step(torch.randn(4, 4), torch.randn(4, 1))
    assert _same(before, _snapshot(pipe)) and pipe.flushed
    ok = Pipeline(_stages(2), schedule=schedule, chunks=2, loss_fn=mse, optimizer=sgd)
    with pytest.raises(PipelineInputError, match=r"stage 0 .* input micro-batch of shape \(2, 3\)"):
        ok.step(torch.randn(4, 3), torch.randn(4, 1))
    with pytest.raises(PipelineInputError, match="loss_fn cannot compare"):
        ok.step(torch.randn(4, 4), torch.randn(4, 3, 2))  # cannot broadcast with (2, 1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(schedule="zigzag"), "unknown schedule 'zigzag'; known schedules: naive, gpipe"),
        (dict(schedule="2bw", chunks=2), r"2bw needs chunks >= stages \(M >= S\)"),
        (dict(schedule="gpipe", update_size=2), r"update_size must equal chunks \(M=4\)"),
        (dict(schedule="pipedream", weight_prediction="lwp"), "already uses stashed weights"),
        (dict(schedule="gpipe", weight_prediction="spectrain"), "has no delay"),
        (dict(schedule="gpipe", discrepancy_correction=True), "invalid with schedule 'gpipe'"),
        (
            dict(schedule="pb", weight_prediction="lwp", discrepancy_correction=True),
            "at most one backward-weight mitigation",
        ),
        (dict(schedule="pb", weight_prediction="magic"), "weight_prediction='magic'"),
        (dict(schedule="gpipe", order="1f1b"), "runs in order 'fill-drain', not '1f1b'"),
        (dict(schedule="pb", transport="gloo"), "transport='gloo' needs one process per stage"),
        (dict(schedule="pb", transport="mpi"), "transport='mpi' is not available"),
        (dict(schedule="gpipe", data_parallel=2), "data_parallel=2 needs one process"),
        (dict(schedule="pb", checkpoint="sometimes"), "checkpoint='sometimes'"),
        (dict(schedule="pb", on_nonfinite="ignore"), "on_nonfinite='ignore'"),
        (dict(schedule="pb", chunks=0), "chunks must be >= 1, got 0"),
        (dict(schedule="pb", update_size=0), "update_size must be >= 1, got 0"),
    ],
)
def test_invalid_combinations(kwargs: dict, match: str) -> None:
    kw = dict(chunks=4, loss_fn=mse, optimizer=sgd) | kwargs
    with pytest.raises(PipelineConfigError, match=match):
        Pipeline(_stages(3), **kw)


def test_prediction_needs_a_predicting_optimizer() -> None:
    with pytest.raises(PipelineConfigError, match="prediction='linear'"):
        Pipeline(
            _stages(),
            schedule="pb",
            chunks=2,
            loss_fn=mse,
            optimizer=lambda p: optim.SGD(p, lr=0.1),
            weight_prediction="lwp",
        )
    with pytest.raises(PipelineConfigError, match="already uses stashed weights"):
        Pipeline(
            _stages(),
            schedule="pipedream",
            chunks=2,
            loss_fn=mse,
            optimizer=lambda p: optim.SGD(p, lr=0.1, momentum=0.9, prediction="linear"),
        )


@pytest.mark.parametrize("variant", ["spectrain", "spectrain_reuse"])
def test_spectrain_refuses_the_momentum_prediction_form(variant: str) -> None:
    """SpecTrain's horizon is linear (s * lr * v); an optimizer predicting with the momentum
    sum would silently change the method (ALGORITHMS.md), so the combination is refused
    before any stage is built, and the modules keep their weights."""
    stages = _stages()
    before = [p.detach().clone() for m in stages for p in m.parameters()]
    with pytest.raises(PipelineConfigError, match="SpecTrain's linear extrapolation.*prediction='linear'"):
        Pipeline(
            stages,
            schedule="pb",
            chunks=2,
            loss_fn=mse,
            optimizer=lambda p: optim.SGD(p, lr=0.1, momentum=0.9, prediction="momentum"),
            weight_prediction=variant,
        )
    assert _same(before, [p.detach() for m in stages for p in m.parameters()])


@pytest.mark.parametrize("schedule", ["1f1b", "pb"])
def test_zero_size_batch_is_refused_and_changes_nothing(schedule: str) -> None:
    pipe = Pipeline(_stages(), schedule=schedule, chunks=2, loss_fn=mse, optimizer=sgd)
    pipe.step(torch.randn(4, 4), torch.randn(4, 1))
    before = _snapshot(pipe)
    with pytest.raises(PipelineInputError, match=r"the batch is empty \(0 samples\)"):
        pipe.step(torch.randn(0, 4), torch.randn(0, 1))
    assert _same(before, _snapshot(pipe))
    pipe.step(torch.randn(4, 4), torch.randn(4, 1))  # and the pipeline goes on


def _nan_batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.randn(n, 4), torch.randn(n, 1)
    y[n // 2] = float("nan")
    return x, y


@pytest.mark.parametrize("schedule", SYNC)
def test_nonfinite_raise_rolls_back_sync_step(schedule: str) -> None:
    a = Pipeline(_stages(), schedule=schedule, chunks=4, loss_fn=mse, optimizer=sgd)
    b = Pipeline(_stages(), schedule=schedule, chunks=4, loss_fn=mse, optimizer=sgd)
    good = (torch.randn(8, 4), torch.randn(8, 1))
    a.step(*good)
    b.step(*good)
    before = _snapshot(a)
    with pytest.raises(NonFiniteLossError, match="rolled back.*on_nonfinite='skip'"):
        a.step(*_nan_batch())
    assert _same(before, _snapshot(a))
    # gradients live in the persistent flat buffers: rolled back means zeroed
    assert all(p.grad is None or not p.grad.any() for st in a.stages for p in st.module.parameters())
    assert a.flushed and a.steps == 1
    nxt = (torch.randn(8, 4), torch.randn(8, 1))
    assert torch.equal(a.step(*nxt), b.step(*nxt))  # as if the bad batch never happened
    assert _same(_snapshot(a), _snapshot(b))


def test_nonfinite_skip_sync_leaves_every_stage_consistent() -> None:
    a = Pipeline(
        _stages(), schedule="1f1b", chunks=4, loss_fn=mse, optimizer=sgd, on_nonfinite="skip"
    )
    b = Pipeline(_stages(), schedule="1f1b", chunks=4, loss_fn=mse, optimizer=sgd)
    good = (torch.randn(8, 4), torch.randn(8, 1))
    a.step(*good)
    b.step(*good)
    loss = a.step(*_nan_batch())
    assert not torch.isfinite(loss)
    st = a.stats()
    assert st["skipped_steps"] == 1 and st["updates"] == [1, 1, 1]
    nxt = (torch.randn(8, 4), torch.randn(8, 1))
    assert torch.equal(a.step(*nxt), b.step(*nxt))
    assert _same(_snapshot(a), _snapshot(b))


@pytest.mark.parametrize("mode", ["skip", "raise"])
@pytest.mark.parametrize("schedule", ASYNC)
def test_nonfinite_async_drops_microbatch_everywhere(schedule: str, mode: str) -> None:
    """The micro-batch is dropped at every stage (zero gradient, its update group renormalised);
    every stage applies the same number of updates and nothing stays in flight after a flush.
    Equivalent to a run where that micro-batch contributes no gradient."""
    M = 4
    a = Pipeline(
        _stages(),
        schedule=schedule,
        chunks=M,
        loss_fn=mse,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        on_nonfinite=mode,
        trace=True,
    )
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
    bad_x, bad_y = batches[1][0].clone(), batches[1][1].clone()
    bad_y[2] = float("nan")  # micro-batch 1 of step 1 -> global micro-batch 5
    batches[1] = (bad_x, bad_y)
    for i, (x, y) in enumerate(batches):
        if i == 1 and mode == "raise":
            with pytest.raises(NonFiniteLossError, match="micro-batch 5"):
                a.step(x, y)
        else:
            a.step(x, y)
    a.flush()
    st = a.stats()
    assert len(set(st["updates"])) == 1
    assert st["dropped_microbatches"] == 1
    for stage in a.stages:
        assert len(stage.stash) == 0 and stage.store.versions_held == 1 and stage.pending == 0
        for p in stage.module.parameters():
            assert torch.isfinite(p).all()
    if schedule == "pb" and mode == "skip":
        # reference: same run where micro-batch 5's loss is multiplied by zero at every stage
        ref = Pipeline(
            _stages(),
            schedule=schedule,
            chunks=M,
            loss_fn=mse,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )
        seen = {"n": -1}  # call 0 is the shape validation, so micro-batch m is call m + 1

        def zeroing_loss(out, target):
            seen["n"] += 1
            loss = mse(out, target)
            return loss * 0.0 if seen["n"] == 6 else loss

        ref.stages[-1].loss_fn = zeroing_loss
        for x, y in batches:
            ref.step(x, torch.nan_to_num(y))
        ref.flush()
        for sa, sb in zip(a.stages, ref.stages, strict=False):
            for pa, pb_ in zip(sa.module.parameters(), sb.module.parameters(), strict=False):
                torch.testing.assert_close(pa, pb_, rtol=1e-6, atol=1e-7)


def test_stages_must_not_be_one_module_object() -> None:
    """Tied parameters and shared submodules are ties (tests/runtime/ties/test_runtime_ties.py); one
    module object as two whole stages is refused, with how to tie instead."""
    lin = nn.Linear(4, 4)
    with pytest.raises(PipelineConfigError, match=r"stage 1 is the module of stage 0 \(Linear\).*uses the shared one"):
        Pipeline([lin, lin], schedule="gpipe", chunks=2, loss_fn=mse, optimizer=sgd)


def test_optimizer_must_be_a_factory() -> None:
    model = _stages()
    with pytest.raises(PipelineConfigError, match="factory"):
        Pipeline(
            model,
            schedule="gpipe",
            chunks=2,
            loss_fn=mse,
            optimizer=torch.optim.SGD(copy.deepcopy(model[0]).parameters(), lr=0.1),
        )


class _CountingStage(nn.Module):
    """Counts its forwards in a buffer, in place, once ``counting`` is on: a step that first
    changes the buffer and then rolls back has no copy of it to restore (the steps before
    taught the rollback point that this buffer never changes)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.register_buffer("seen", torch.zeros(()))
        self.counting = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.counting:
            self.seen.add_(1)
        return self.lin(x)


def test_rollback_warns_about_a_buffer_it_cannot_restore() -> None:
    counter = _CountingStage()
    stages = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()), counter]
    pipe = Pipeline(stages, schedule="1f1b", chunks=4, loss_fn=mse, optimizer=sgd)
    pipe.step(torch.randn(8, 4), torch.randn(8, 1))
    counter.counting = True
    with pytest.warns(RuntimeWarning, match=r"could not restore buffers \['seen'\]"):
        with pytest.raises(NonFiniteLossError, match="rolled back"):
            pipe.step(*_nan_batch())
    assert pipe.steps == 1 and pipe.stages[1].module.seen.item() > 0  # kept, as warned
