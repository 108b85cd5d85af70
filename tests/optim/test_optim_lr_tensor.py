"""engine.optim's optimizers keep a Tensor lr on the device (issue 23): with ``fused`` kernels
and ``lr`` a one-element float32 tensor on the params' device (torch's convention for
capturable optimizers; torch's LR schedulers write it in place), every step reads it in the
kernel: bitwise the result of the same values given as floats, with no host read of the lr
and the tensor at one address throughout. Mitigations that take lr included (SGD's
prediction and spike compensation, AdamW/NAdamW's decoupled decay)."""

from __future__ import annotations

import pytest
import torch
from kernel_support import DEVICE, _on_device  # noqa: F401 (autouse fixture)
from torch import nn

import engine.optim as eo
from engine.runtime.capture.dispatch_trace import Recorder

# a float32 number, and a schedule whose values stay float32 numbers (halving): the float
# path is then given exactly the values the tensor holds
LR = 0.0625
CASES = {
    "sgd_momentum": (eo.SGD, dict(momentum=0.9, weight_decay=1e-2)),
    "sgd_sc_prediction": (eo.SGD, dict(momentum=0.9, delay=2, spike_compensation=True,
                                       prediction="linear", discrepancy_correction=True)),
    "sgd_momentum_prediction": (eo.SGD, dict(momentum=0.9, delay=3, prediction="momentum")),
    "adam_sc": (eo.Adam, dict(delay=2, spike_compensation=True, weight_decay=1e-2)),
    "adamw_prediction": (eo.AdamW, dict(delay=2, prediction="linear", weight_decay=0.1)),
    "nadamw_prediction": (eo.NAdam, dict(delay=1, prediction="linear", weight_decay=0.1,
                                         decoupled_weight_decay=True)),
}


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    # odd sizes; several tensors: the multi-tensor launch (one table per dtype signature)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3)).to(DEVICE, dtype)


def _steps(model, opt, sched, dtype, n=4, record=None):
    gen = torch.Generator(device="cpu").manual_seed(1)
    for k in range(n):
        x = torch.randn(5, 7, generator=gen, device="cpu").to(DEVICE, dtype)
        model(x).float().square().mean().backward()
        if record is not None and k > 0:  # the first step checks the options (a host read)
            with record:
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
        sched.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_tensor_lr_is_bitwise_the_float_lr_and_never_read_on_the_host(case, dtype):
    cls, kw = CASES[case]
    a, b = _model(dtype), _model(dtype)
    lr_t = torch.tensor(LR, device=DEVICE)
    opt_a = cls(a.parameters(), lr=lr_t, fused=True, **kw)
    opt_b = cls(b.parameters(), lr=LR, fused=True, **kw)
    sched_a = torch.optim.lr_scheduler.ExponentialLR(opt_a, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.ExponentialLR(opt_b, gamma=0.5)
    rec = Recorder()
    _steps(a, opt_a, sched_a, dtype, record=rec)
    _steps(b, opt_b, sched_b, dtype)
    assert opt_a.param_groups[0]["lr"] is lr_t and lr_t.item() == LR / 16  # written in place
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values(), strict=True):
        for k, v in sa.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, sb[k]), k
    for u, v in zip(opt_a.predicted_weights(), opt_b.predicted_weights(), strict=True):
        assert torch.equal(u, v)
    syncs = [(op.name, op.where) for op in rec.ops if op.sync is not None]
    assert syncs == [], syncs


def test_the_reference_path_reads_a_tensor_lr_as_a_number():
    """fused=False: the reference path (torch's ops) takes lr as a number, as before."""
    a, b = _model(torch.float32), _model(torch.float32)
    opt_a = eo.SGD(a.parameters(), lr=torch.tensor(LR, device=DEVICE), momentum=0.9, fused=False)
    opt_b = eo.SGD(b.parameters(), lr=LR, momentum=0.9, fused=False)
    for m, o in ((a, opt_a), (b, opt_b)):
        _steps(m, o, torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5), torch.float32)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_load_state_dict_keeps_the_device_lr_tensor():
    """Loading a state_dict copies a saved lr into the Tensor lr the group holds: its address
    (what a captured step and the kernels read) survives a resume."""
    m = _model(torch.float32)
    lr = torch.tensor(LR, device=DEVICE)
    opt = eo.SGD(m.parameters(), lr=lr, momentum=0.9, fused=True)
    _steps(m, opt, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5), torch.float32, n=2)
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = torch.tensor(0.5)  # as loaded from a file: on the CPU
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["sgd_sc_prediction", "sgd_momentum_prediction"])
def test_a_prediction_recomputed_at_another_horizon_keeps_a_device_lr_on_the_device(case, dtype):
    """predicted_weights(horizon) recomputes w - c * direction with the lr of the last step:
    with a device lr the coefficient stays a tensor (no host read: a captured pb window
    recomputing an LWP prediction must not read back; the H100 run of 2026-11-26 found such
    windows eager for good), and the weights are those of the same lr given as a float (one
    multiply-add: equal up to the rounding of a fused versus a separate product)."""
    cls, kw = CASES[case]
    a, b = _model(dtype), _model(dtype)
    opt_a = cls(a.parameters(), lr=torch.tensor(LR, device=DEVICE), fused=True, **kw)
    opt_b = cls(b.parameters(), lr=LR, fused=True, **kw)
    for m, o in ((a, opt_a), (b, opt_b)):
        _steps(m, o, torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5), dtype, n=3)
    rec = Recorder()
    with rec:
        ours = opt_a.predicted_weights(horizon=5)
    syncs = [(op.name, op.where) for op in rec.ops if op.sync is not None]
    assert syncs == [], syncs
    theirs = opt_b.predicted_weights(horizon=5)
    assert len(ours) == len(theirs) == 4
    for u, v, p in zip(ours, theirs, a.parameters(), strict=True):
        assert u.dtype == p.dtype
        torch.testing.assert_close(u, v)
        assert not torch.equal(u, p.detach())  # a prediction, not the live weights
