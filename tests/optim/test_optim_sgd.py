"""engine.optim.SGD: bitwise equality with torch.optim.SGD, and the delay mitigations against
slow references written directly from ALGORITHMS.md's formulas (reference path, fused=False)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.optim as eo

STEPS = 20


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Small model with odd-sized params (7x5, 5, 3x5, 3, 1x3) and a param-free layer."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 1, bias=False)).to(dtype)


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


@pytest.mark.parametrize(
    "cfg",
    [
        dict(lr=0.05),
        dict(lr=0.05, weight_decay=0.01),
        dict(lr=0.03, momentum=0.9),
        dict(lr=0.03, momentum=0.9, nesterov=True, weight_decay=0.1),
        dict(lr=0.03, momentum=0.7, dampening=0.3),
        dict(lr=0.03, momentum=0.8, maximize=True, weight_decay=0.05),
    ],
)
def test_bitwise_equal_to_torch_sgd(cfg: dict) -> None:
    ref, ours = make_model(), make_model()
    xs = batches(STEPS)
    train(ref, torch.optim.SGD(ref.parameters(), foreach=False, **cfg), xs)
    train(ours, eo.SGD(ours.parameters(), **cfg), xs)
    assert params_equal(ref, ours)
    # and the run actually moved the weights (the comparison is not vacuous)
    assert not params_equal(ours, make_model())


def test_spike_compensation_d1_is_nesterov_bitwise() -> None:
    ref, ours = make_model(), make_model()
    xs = batches(STEPS)
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.03, momentum=0.9, weight_decay=0.01, nesterov=True, foreach=False), xs)
    train(ours, eo.SGD(ours.parameters(), lr=0.03, momentum=0.9, weight_decay=0.01, delay=1, spike_compensation=True), xs)
    assert params_equal(ref, ours)


@pytest.mark.parametrize("delay", [1, 3])
def test_spike_compensation_without_momentum_is_plain_sgd(delay: int) -> None:
    ref, ours = make_model(), make_model()
    xs = batches(8)
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.05, weight_decay=0.01, foreach=False), xs)
    train(ours, eo.SGD(ours.parameters(), lr=0.05, weight_decay=0.01, delay=delay, spike_compensation=True), xs)
    assert params_equal(ref, ours)


def slow_sgd_sc(ws: list[torch.Tensor], grads_of, steps: int, lr: float, m: float, d: float, wd: float, D: int) -> list[torch.Tensor]:
    """SC_D straight from ALGORITHMS.md in float64: v = m v + (1-d) g'; w -= lr (a v + b (1-d) g')."""
    ws = [w.double().clone() for w in ws]
    vs = [None] * len(ws)
    a, b = m**D, (1 - m**D) / (1 - m)
    for k in range(steps):
        gs = grads_of([w.float() for w in ws], k)
        for i, (w, g) in enumerate(zip(ws, gs, strict=True)):
            g = g.double() + wd * w
            vs[i] = g.clone() if vs[i] is None else m * vs[i] + (1 - d) * g
            w -= lr * (a * vs[i] + b * (1 - d) * g)
    return ws


def test_spike_compensation_matches_formula() -> None:
    torch.manual_seed(3)
    targets = [torch.randn(4, 3), torch.randn(5)]
    init = [torch.randn(4, 3), torch.randn(5)]

    def grads_of(ws: list[torch.Tensor], k: int) -> list[torch.Tensor]:  # quadratic loss, known grad
        return [(w - t) * (1 + 0.1 * k) for w, t in zip(ws, targets, strict=True)]

    params = [nn.Parameter(w.clone()) for w in init]
    opt = eo.SGD(params, lr=0.05, momentum=0.8, dampening=0.1, weight_decay=0.02, delay=3, spike_compensation=True)
    for k in range(10):
        for p, g in zip(params, grads_of([p.detach() for p in params], k), strict=True):
            p.grad = g
        opt.step()
    expected = slow_sgd_sc(init, grads_of, 10, 0.05, 0.8, 0.1, 0.02, 3)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)
    # SC_3 differs from plain momentum SGD here (the option does something)
    plain = slow_sgd_sc(init, grads_of, 10, 0.05, 0.8, 0.1, 0.02, 0)
    assert not torch.allclose(params[0].detach().double(), plain[0], atol=1e-4)


def test_prediction_momentum_h1_is_nesterov_lookahead() -> None:
    model = make_model()
    opt = eo.SGD(model.parameters(), lr=0.03, momentum=0.9, delay=1, prediction="momentum")
    train(model, opt, batches(5))
    preds = opt.predicted_weights()
    for p, w_hat in zip(model.parameters(), preds, strict=True):
        v = opt.state[p]["momentum_buffer"]
        torch.testing.assert_close(w_hat, p.detach() - 0.03 * 0.9 * v, rtol=0, atol=1e-7)
    # the look-ahead equals the weights a torch Nesterov step would reach with a zero gradient
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.03, momentum=0.9, foreach=False)
    train(ref, ref_opt, batches(5))
    for p in ref.parameters():
        p.grad = torch.zeros_like(p)
    ref_opt.step()  # v <- m v, w <- w - lr m v
    for q, w_hat in zip(ref.parameters(), preds, strict=True):
        torch.testing.assert_close(w_hat, q.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode,horizon", [("linear", None), ("linear", 2.5), ("momentum", 3)])
def test_prediction_formula_and_on_demand_horizons(mode: str, horizon: float | None) -> None:
    lr, m, delay = 0.02, 0.85, 4
    model = make_model()
    opt = eo.SGD(model.parameters(), lr=lr, momentum=m, delay=delay, prediction=mode, prediction_horizon=horizon)
    train(model, opt, batches(4))
    H = delay if horizon is None else horizon
    coeff = lr * H if mode == "linear" else lr * sum(m**i for i in range(1, int(H) + 1))
    params = list(model.parameters())
    for p, w_hat in zip(params, opt.predicted_weights(), strict=True):
        torch.testing.assert_close(w_hat, p.detach() - coeff * opt.state[p]["momentum_buffer"], rtol=0, atol=1e-6)
    # another horizon, on demand
    coeff7 = lr * 7 if mode == "linear" else lr * sum(m**i for i in range(1, 8))
    for p, w_hat in zip(params, opt.predicted_weights(horizon=7), strict=True):
        torch.testing.assert_close(w_hat, p.detach() - coeff7 * opt.state[p]["momentum_buffer"], rtol=0, atol=1e-6)
    # horizon 0 gives the live weights
    for p, w_hat in zip(params, opt.predicted_weights(horizon=0), strict=True):
        assert torch.equal(w_hat, p.detach())


def test_prediction_does_not_change_the_update() -> None:
    ref, ours = make_model(), make_model()
    xs = batches(6)
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.03, momentum=0.9, foreach=False), xs)
    train(ours, eo.SGD(ours.parameters(), lr=0.03, momentum=0.9, delay=2, prediction="linear"), xs)
    assert params_equal(ref, ours)


def test_per_group_delay_and_prediction() -> None:
    model = make_model()
    first, second = list(model[0].parameters()), list(model[2].parameters()) + list(model[3].parameters())
    opt = eo.SGD(
        [{"params": first, "delay": 3}, {"params": second, "delay": 1, "prediction": None}],
        lr=0.02, momentum=0.9, prediction="linear",
    )
    assert [g["delay"] for g in opt.param_groups] == [3, 1]
    train(model, opt, batches(3))
    preds = opt.predicted_weights()
    assert len(preds) == len(first) + len(second)
    for p, w_hat in zip(first, preds[: len(first)], strict=True):
        torch.testing.assert_close(w_hat, p.detach() - 0.02 * 3 * opt.state[p]["momentum_buffer"], rtol=0, atol=1e-7)
    for p, w_hat in zip(second, preds[len(first):], strict=True):
        assert torch.equal(w_hat, p.detach())  # no prediction in that group


def test_discrepancy_correction_matches_direct_computation() -> None:
    lr, m, delay, decay = 0.03, 0.9, 4, 0.1
    model = make_model()
    opt = eo.SGD(model.parameters(), lr=lr, momentum=m, delay=delay, discrepancy_correction=True, correction_decay=decay)
    gamma = decay ** (1 / delay)
    params = list(model.parameters())
    deltas = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for x in batches(6):
        before = [p.detach().double().clone() for p in params]
        opt.zero_grad()
        model(x).sin().sum().backward()
        opt.step()
        for i, p in enumerate(params):
            deltas[i] = gamma * deltas[i] + (1 - gamma) * (p.detach().double() - before[i])
    for p, d, bw in zip(params, deltas, opt.backward_weights(), strict=True):
        torch.testing.assert_close(opt.state[p]["delta"].double(), d, rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(bw.double(), p.detach().double() - delay * d, rtol=1e-5, atol=1e-7)
        assert not torch.equal(bw, p.detach())


def test_discrepancy_correction_with_delay_zero_keeps_no_delta() -> None:
    model = make_model()
    opt = eo.SGD(model.parameters(), lr=0.03, momentum=0.9, discrepancy_correction=True)
    train(model, opt, batches(2))
    assert all("delta" not in opt.state[p] for p in model.parameters())
    for p, bw in zip(model.parameters(), opt.backward_weights(), strict=True):
        assert torch.equal(bw, p.detach())
