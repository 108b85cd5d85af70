"""engine.optim.Adam / AdamW: bitwise equality with torch.optim, and the project's own delay
compensation for Adam (ALGORITHMS.md) against slow float64 references written from the
formulas (reference path, fused=False)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.optim as eo

STEPS = 20


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 1, bias=False))


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 7, generator=g) for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> None:
    for x in xs:
        opt.zero_grad()
        model(x).sin().sum().backward()
        opt.step()


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


CONFIGS = [
    dict(lr=0.01),
    dict(lr=0.01, weight_decay=0.1),
    dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, amsgrad=True),
    dict(lr=0.01, maximize=True, weight_decay=0.05, amsgrad=True),
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("ours_cls,torch_cls", [(eo.Adam, torch.optim.Adam), (eo.AdamW, torch.optim.AdamW)])
def test_bitwise_equal_to_torch(ours_cls, torch_cls, cfg: dict) -> None:
    ref, ours = make_model(), make_model()
    xs = batches(STEPS)
    ref_opt = torch_cls(ref.parameters(), foreach=False, **cfg)
    our_opt = ours_cls(ours.parameters(), **cfg)
    train(ref, ref_opt, xs)
    train(ours, our_opt, xs)
    assert params_equal(ref, ours)
    assert not params_equal(ours, make_model())
    # same state layout and values as torch (state_dict interchangeable)
    for p, q in zip(ref.parameters(), ours.parameters(), strict=True):
        for key, value in ref_opt.state[p].items():
            assert torch.equal(our_opt.state[q][key], value), key


def test_adamw_default_weight_decay_is_torchs() -> None:
    p = nn.Parameter(torch.ones(3))
    assert eo.AdamW([p]).param_groups[0]["weight_decay"] == torch.optim.AdamW([p]).param_groups[0]["weight_decay"] == 1e-2
    assert eo.Adam([p]).param_groups[0]["weight_decay"] == 0


def slow_adam(init, grads_of, steps, lr, b1, b2, eps, wd, decoupled, amsgrad, D):
    """Adam/AdamW with SC_D from ALGORITHMS.md, float64; returns weights and last steps."""
    ws = [w.double().clone() for w in init]
    us = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    vmax = [torch.zeros_like(w) for w in ws]
    last = [torch.zeros_like(w) for w in ws]
    for k in range(steps):
        t = k + 1
        gs = grads_of([w.float() for w in ws], k)
        for i, g in enumerate(gs):
            w = ws[i]
            old = w.clone()
            g = g.double()
            if wd and decoupled:
                w *= 1 - lr * wd
            elif wd:
                g = g + wd * w
            us[i] = b1 * us[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            vmax[i] = torch.maximum(vmax[i], vs[i])
            u_hat = us[i] / (1 - b1**t)
            v_hat = (vmax[i] if amsgrad else vs[i]) / (1 - b2**t)
            numer = b1**D * u_hat + (1 - b1**D) * g
            w -= lr * numer / (v_hat.sqrt() + eps)
            last[i] = old - w
    return ws, last


def quadratic_problem():
    torch.manual_seed(5)
    targets = [torch.randn(4, 3), torch.randn(5)]
    init = [torch.randn(4, 3), torch.randn(5)]

    def grads_of(ws, k):
        return [(w - t) * (1 + 0.2 * k) for w, t in zip(ws, targets, strict=True)]

    return init, grads_of


def run_ours(cls, init, grads_of, steps, **kw):
    params = [nn.Parameter(w.clone()) for w in init]
    opt = cls(params, **kw)
    for k in range(steps):
        for p, g in zip(params, grads_of([p.detach() for p in params], k), strict=True):
            p.grad = g
        opt.step()
    return params, opt


@pytest.mark.parametrize("cls,decoupled", [(eo.Adam, False), (eo.AdamW, True)])
@pytest.mark.parametrize("D,amsgrad", [(2, False), (1, True)])
def test_spike_compensation_matches_formula(cls, decoupled: bool, D: int, amsgrad: bool) -> None:
    init, grads_of = quadratic_problem()
    kw = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad)
    params, _ = run_ours(cls, init, grads_of, 8, delay=D, spike_compensation=True, **kw)
    expected, _ = slow_adam(init, grads_of, 8, 0.05, 0.8, 0.95, 1e-8, 0.1, decoupled, amsgrad, D)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)
    plain, _ = slow_adam(init, grads_of, 8, 0.05, 0.8, 0.95, 1e-8, 0.1, decoupled, amsgrad, 0)
    assert not torch.allclose(plain[0], expected[0], atol=1e-4)  # SC changes the trajectory


@pytest.mark.parametrize("cls,decoupled", [(eo.Adam, False), (eo.AdamW, True)])
@pytest.mark.parametrize("mode", ["linear", "momentum"])
def test_prediction_extrapolates_last_step(cls, decoupled: bool, mode: str) -> None:
    init, grads_of = quadratic_problem()
    b1, delay = 0.8, 3
    params, opt = run_ours(cls, init, grads_of, 5, lr=0.05, betas=(b1, 0.95), weight_decay=0.1, delay=delay, prediction=mode)
    ws, last = slow_adam(init, grads_of, 5, 0.05, b1, 0.95, 1e-8, 0.1, decoupled, False, 0)
    mult = (lambda H: H) if mode == "linear" else (lambda H: sum(b1**i for i in range(1, H + 1)))
    for p, w_hat, last_step in zip(params, opt.predicted_weights(), last, strict=True):
        torch.testing.assert_close(opt.state[p]["last_update"].double(), last_step, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(w_hat.double(), p.detach().double() - mult(delay) * last_step, rtol=1e-5, atol=1e-6)
    for p, w_hat, last_step in zip(params, opt.predicted_weights(horizon=6), last, strict=True):
        torch.testing.assert_close(w_hat.double(), p.detach().double() - mult(6) * last_step, rtol=1e-5, atol=1e-6)


def test_prediction_does_not_change_the_update() -> None:
    ref, ours = make_model(), make_model()
    xs = batches(6)
    train(ref, torch.optim.Adam(ref.parameters(), lr=0.01, foreach=False), xs)
    train(ours, eo.Adam(ours.parameters(), lr=0.01, delay=2, prediction="linear", discrepancy_correction=True), xs)
    assert params_equal(ref, ours)


def test_discrepancy_correction_matches_direct_computation() -> None:
    delay, decay = 2, 0.3
    model = make_model()
    opt = eo.AdamW(model.parameters(), lr=0.01, delay=delay, discrepancy_correction=True, correction_decay=decay)
    gamma = decay ** (1 / delay)
    params = list(model.parameters())
    deltas = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for x in batches(5):
        before = [p.detach().double().clone() for p in params]
        opt.zero_grad()
        model(x).sin().sum().backward()
        opt.step()
        for i, p in enumerate(params):
            deltas[i] = gamma * deltas[i] + (1 - gamma) * (p.detach().double() - before[i])
    for p, d, bw in zip(params, deltas, opt.backward_weights(), strict=True):
        torch.testing.assert_close(opt.state[p]["delta"].double(), d, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(bw.double(), p.detach().double() - delay * d, rtol=1e-5, atol=1e-8)
