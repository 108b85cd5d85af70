"""PipeMareLR (PipeMare T1): the multiplier tau_s ** -(1 - min(k/K, 1)) per group, exactly,
alone and chained with StepLR / OneCycleLR, and the rate the optimizer's update actually
uses, which is what group["lr"] and get_last_lr() show (as torch's schedulers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.optim as eo


def formula(lr_k: float, tau: int, k: int, K: int) -> float:
    progress = 1.0 if K == 0 else min(k / K, 1.0)
    return lr_k * float(max(tau, 1)) ** -(1.0 - progress)


def three_groups(cls=eo.SGD, **kw):
    params = [nn.Parameter(torch.randn(4)) for _ in range(3)]
    opt = cls([{"params": [params[0]], "delay": 6}, {"params": [params[1]], "delay": 2}, {"params": [params[2]], "delay": 0}], **kw)
    return params, opt


def test_values_match_formula() -> None:
    _, opt = three_groups(lr=0.1, momentum=0.9)
    K = 5
    sched = eo.PipeMareLR(opt, warmup_steps=K)
    for k in range(9):
        expected = [formula(0.1, tau, k, K) for tau in (6, 2, 0)]
        assert opt.effective_lrs() == expected  # exact: same float expression
        assert sched.get_last_lr() == expected
        assert [g["lr"] for g in opt.param_groups] == expected  # the applied rate, as torch's
        opt.step()
        sched.step()
    assert opt.effective_lrs() == [0.1, 0.1, 0.1]  # after warm-up the multiplier is 1
    assert formula(0.1, 6, 0, K) == pytest.approx(0.1 / 6)


def test_zero_warmup_means_no_rescaling() -> None:
    _, opt = three_groups(lr=0.1)
    eo.PipeMareLR(opt, warmup_steps=0)
    assert opt.effective_lrs() == [0.1, 0.1, 0.1]


@pytest.mark.parametrize("pipemare_first", [True, False])
def test_chained_with_step_lr(pipemare_first: bool) -> None:
    _, opt = three_groups(cls=eo.Adam, lr=0.01)
    _, ref_opt = three_groups(cls=eo.Adam, lr=0.01)
    K = 4
    if pipemare_first:
        pm = eo.PipeMareLR(opt, warmup_steps=K)
        step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    else:
        step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        pm = eo.PipeMareLR(opt, warmup_steps=K)
    ref_step = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)  # lr_k alone
    for k in range(8):
        lr_k = ref_opt.param_groups[0]["lr"]
        expected = [formula(lr_k, tau, k, K) for tau in (6, 2, 0)]
        # both chainable: the products agree up to the order of the roundings
        assert opt.effective_lrs() == pytest.approx(expected, rel=1e-14)
        assert [g["lr"] for g in opt.param_groups] == opt.effective_lrs()
        opt.step()
        ref_opt.step()
        for s in ((pm, step_lr) if k % 2 else (step_lr, pm)):  # order must not matter
            s.step()
        ref_step.step()
    assert ref_opt.param_groups[0]["lr"] == 0.01 * 0.5**4


def test_chained_with_one_cycle() -> None:
    _, opt = three_groups(lr=0.1, momentum=0.9)
    _, ref_opt = three_groups(lr=0.1, momentum=0.9)
    total, K = 12, 6
    one = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=total)
    pm = eo.PipeMareLR(opt, warmup_steps=K, absolute_base=True)  # OneCycleLR writes lr_k whole
    ref_one = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=0.5, total_steps=total)
    seen = set()
    for k in range(total - 1):
        lr_k = ref_opt.param_groups[0]["lr"]
        seen.add(lr_k)
        assert opt.effective_lrs() == [formula(lr_k, tau, k, K) for tau in (6, 2, 0)]
        assert pm.get_last_lr() == [g["lr"] for g in opt.param_groups] == opt.effective_lrs()
        opt.step()
        ref_opt.step()
        one.step()
        pm.step()
        ref_one.step()
    assert len(seen) > 5  # the base schedule really varied


def test_update_uses_the_scaled_rate() -> None:
    p = nn.Parameter(torch.randn(5))
    opt = eo.SGD([p], lr=0.1, delay=4)
    eo.PipeMareLR(opt, warmup_steps=10)
    g = torch.randn(5)
    p.grad = g.clone()
    before = p.detach().clone()
    opt.step()
    assert torch.equal(p.detach(), before.add(g, alpha=-formula(0.1, 4, 0, 10)))


def test_delay_read_at_each_step_and_state_dict() -> None:
    _, opt = three_groups(lr=0.1)
    sched = eo.PipeMareLR(opt, warmup_steps=4)
    opt.param_groups[2]["delay"] = 3  # the pipeline sets delays after construction
    opt.step()
    sched.step()
    assert opt.effective_lrs()[2] == formula(0.1, 3, 1, 4)
    # lr_scale travels with the optimizer's state_dict, k with the scheduler's
    _, opt2 = three_groups(lr=0.1)
    sched2 = eo.PipeMareLR(opt2, warmup_steps=4)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert opt2.effective_lrs() == opt.effective_lrs()
    opt.step(); sched.step(); opt2.step(); sched2.step()  # noqa: E702
    assert opt2.effective_lrs() == opt.effective_lrs() == [formula(0.1, t, 2, 4) for t in (6, 2, 3)]


def test_rejects_bad_arguments() -> None:
    p = nn.Parameter(torch.randn(2))
    with pytest.raises(TypeError, match="needs an engine.optim optimizer.*'delay'"):
        eo.PipeMareLR(torch.optim.SGD([p], lr=0.1), warmup_steps=3)
    opt = eo.SGD([p], lr=0.1)
    with pytest.raises(ValueError, match="warmup_steps=-1 is invalid"):
        eo.PipeMareLR(opt, warmup_steps=-1)
    assert "pipemare_scale" not in opt.param_groups[0] and opt.param_groups[0]["lr"] == 0.1


def test_an_old_checkpoint_with_lr_scale_is_not_scaled_twice() -> None:
    """Before issue 22 the multiplier was group["lr_scale"], applied inside the step, and
    group["lr"] the base rate: such a state_dict resumes with the multiplier applied once."""
    _, opt = three_groups(lr=0.1)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g["lr_scale"] = float(max(g["delay"], 1)) ** -0.5
    _, fresh = three_groups(lr=0.1)
    fresh.load_state_dict(sd)
    assert fresh.effective_lrs() == [formula(0.1, t, 2, 4) for t in (6, 2, 0)]  # as before
    sched = eo.PipeMareLR(fresh, warmup_steps=4, last_epoch=-1)
    assert fresh.effective_lrs() == [formula(0.1, t, 0, 4) for t in (6, 2, 0)]
    assert all("lr_scale" not in g for g in fresh.param_groups)
    sched.step()
    assert [g["lr"] for g in fresh.param_groups] == [formula(0.1, t, 1, 4) for t in (6, 2, 0)]


def test_a_tensor_lr_is_rescaled_in_place() -> None:
    p = nn.Parameter(torch.randn(3))
    lr = torch.tensor(0.1)
    opt = eo.SGD([p], lr=lr, delay=4)
    sched = eo.PipeMareLR(opt, warmup_steps=2)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(formula(0.1, 4, 0, 2))
    sched.step()
    sched.step()
    assert float(lr) == pytest.approx(0.1) and sched.get_last_lr()[0] is lr


def test_predictions_after_load_use_the_lr_of_the_last_step() -> None:
    """LWP with PipeMareLR: the scheduler changes lr_scale after a step, so a prediction
    recomputed after load_state_dict must extrapolate with the lr the last step used, exactly
    as the one the step itself wrote (otherwise a resumed run diverges from an uninterrupted one)."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(37))
    opt = eo.SGD([p], lr=0.1, momentum=0.9, delay=4, prediction="linear")
    sched = eo.PipeMareLR(opt, warmup_steps=10)
    for _ in range(3):
        p.grad = torch.randn(37)
        opt.step()
        sched.step()
    written_by_step = [t.clone() for t in opt.predicted_weights()]
    other_horizon = [t.clone() for t in opt.predicted_weights(horizon=2)]

    q = nn.Parameter(p.detach().clone())
    fresh = eo.SGD([q], lr=0.1, momentum=0.9, delay=4, prediction="linear")
    eo.PipeMareLR(fresh, warmup_steps=10)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.effective_lrs() != [fresh.param_groups[0]["prediction_lr"]]  # the scale moved on
    assert torch.equal(fresh.predicted_weights()[0], written_by_step[0])
    assert torch.equal(fresh.predicted_weights(horizon=2)[0], other_horizon[0])
