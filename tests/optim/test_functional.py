"""The reference optimizer math (engine.optim.functional) against torch.optim and ALGORITHMS.md.

With the mitigations off the reference must equal torch.optim's single-tensor SGD / Adam /
AdamW bit for bit (the drop-in promise of engine.optim rests on it). The mitigations are
checked against their defining properties: SC with D = 1 is Nesterov, SC preserves a
gradient's total contribution, the "momentum" prediction at H = 1 is the Nesterov
look-ahead, and Adam's SC/prediction agree with a slow float64 per-element transcription of
the formulas in ALGORITHMS.md.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.optim.functional import (
    adam_update,
    predict,
    prediction_coeff,
    sgd_update,
    spike_coeffs,
)

STEPS = 20


def _grads(n: int, steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(steps)]


def _run_torch(opt_cls, w0, grads, **kw):
    p = torch.nn.Parameter(w0.clone())
    opt = opt_cls([p], foreach=False, **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _run_sgd(w0, grads, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
             nesterov=False, maximize=False, **extra):
    w = w0.clone()
    buf = torch.zeros_like(w) if momentum != 0 else None
    for i, g in enumerate(grads):
        sgd_update(w, g, buf, lr=lr, momentum=momentum, dampening=dampening,
                   weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                   init_momentum=i == 0, **extra)
    return w, buf


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-3, maximize=True),
    dict(lr=0.03, momentum=0.8, dampening=0.3, weight_decay=1e-3),
    dict(lr=0.01, momentum=0.99, dampening=0.1, maximize=True),
    dict(lr=0.1, weight_decay=0.1, maximize=True),
]


@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sgd_matches_torch_bitwise(kw):
    w0 = torch.randn(257, generator=torch.Generator().manual_seed(1))
    grads = _grads(257, STEPS, seed=2)
    expected = _run_torch(torch.optim.SGD, w0, grads, **kw)
    got, _ = _run_sgd(w0, grads, **kw)
    assert torch.equal(got, expected)


ADAM_CASES = [
    dict(lr=1e-3),
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6),
    dict(lr=1e-3, weight_decay=1e-2),
    dict(lr=1e-3, amsgrad=True),
    dict(lr=3e-3, weight_decay=1e-1, amsgrad=True, maximize=True),
    dict(lr=1e-3, betas=(0.3, 0.9), maximize=True),  # lerp weight >= 0.5 branch
]


def _run_adam(w0, grads, *, decoupled, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
              amsgrad=False, maximize=False, **extra):
    w = w0.clone()
    m, v, vmax = torch.zeros_like(w), torch.zeros_like(w), torch.zeros_like(w)
    step = torch.tensor(0.0)
    for g in grads:
        adam_update(w, g, m, v, vmax, step=step, lr=lr, beta1=betas[0], beta2=betas[1],
                    eps=eps, weight_decay=weight_decay, decoupled=decoupled, amsgrad=amsgrad,
                    maximize=maximize, **extra)
    return w, m, v, step


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("kw", ADAM_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_adam_matches_torch_bitwise(kw, decoupled):
    w0 = torch.randn(257, generator=torch.Generator().manual_seed(3))
    grads = _grads(257, STEPS, seed=4)
    opt_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    kw_t = dict(kw)
    if decoupled and "weight_decay" not in kw_t:
        kw_t["weight_decay"] = 0.0  # AdamW's default is 1e-2; keep the cases identical
    expected = _run_torch(opt_cls, w0, grads, **kw_t)
    got, _, _, step = _run_adam(w0, grads, decoupled=decoupled, **kw_t)
    assert step.item() == STEPS
    assert torch.equal(got, expected)


# --------------------------------------------------------------------------- spike compensation


@pytest.mark.parametrize("wd", [0.0, 1e-2])
def test_sc_delay_one_is_torch_nesterov_bitwise(wd):
    w0 = torch.randn(300, generator=torch.Generator().manual_seed(5))
    grads = _grads(300, STEPS, seed=6)
    expected = _run_torch(torch.optim.SGD, w0, grads, lr=0.05, momentum=0.9, nesterov=True,
                          weight_decay=wd)
    got, _ = _run_sgd(w0, grads, lr=0.05, momentum=0.9, weight_decay=wd, sc_delay=1)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("delay", [1, 3, 7])
def test_sc_with_zero_momentum_is_plain_sgd(delay):
    assert spike_coeffs(0.0, delay) == (0.0, 1.0)
    w0 = torch.randn(100, generator=torch.Generator().manual_seed(7))
    grads = _grads(100, STEPS, seed=8)
    expected = _run_torch(torch.optim.SGD, w0, grads, lr=0.1, weight_decay=1e-2)
    got, _ = _run_sgd(w0, grads, lr=0.1, weight_decay=1e-2, sc_delay=delay)
    assert torch.equal(got, expected)


def test_spike_coeffs_values():
    assert spike_coeffs(0.9, 0) == (1.0, 0.0)
    assert spike_coeffs(0.9, 1) == (0.9, 1.0)
    a, b = spike_coeffs(0.9, 3)
    assert a == pytest.approx(0.729, rel=1e-15)
    assert b == pytest.approx(1 + 0.9 + 0.81, rel=1e-15)
    assert spike_coeffs(1.0, 4) == (1.0, 4.0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="delay"):
            spike_coeffs(0.9, bad)
    with pytest.raises(ValueError, match="momentum"):
        spike_coeffs(1.5, 2)


@pytest.mark.parametrize("delay", [1, 3, 7])
def test_sc_total_contribution_of_one_gradient(delay):
    """One unit gradient then zeros for 2000 steps: the total move is lr / (1 - m), the same
    as undelayed momentum SGD, and the contributions after the first step are plain
    momentum's shifted by D steps."""
    lr, m, horizon = 0.1, 0.9, 2000
    w = torch.zeros(1)
    buf = torch.zeros(1)
    moves = []
    for i in range(horizon):
        g = torch.ones(1) if i == 0 else torch.zeros(1)
        before = w.clone()
        sgd_update(w, g, buf, lr=lr, momentum=m, dampening=0.0, weight_decay=0.0,
                   nesterov=False, maximize=False, init_momentum=i == 0, sc_delay=delay)
        moves.append((before - w).item())
    assert sum(moves) == pytest.approx(lr / (1 - m), rel=1e-5)
    # exact in float64: b + a * sum_k m^k
    a, b = spike_coeffs(m, delay)
    assert lr * (b + a / (1 - m)) == pytest.approx(lr / (1 - m), rel=1e-12)
    for k in range(1, 30):
        assert moves[k] == pytest.approx(lr * m ** (k + delay), rel=1e-4)


# --------------------------------------------------------------------------- prediction


def test_prediction_coeff():
    assert prediction_coeff("linear", 0.1, 0.9, 3) == pytest.approx(0.3)
    assert prediction_coeff("linear", 0.1, 0.9, 2.5) == pytest.approx(0.25)
    assert prediction_coeff("momentum", 0.1, 0.9, 0) == 0.0
    assert prediction_coeff("momentum", 0.1, 0.9, 1) == pytest.approx(0.09)
    assert prediction_coeff("momentum", 0.1, 0.9, 3) == pytest.approx(0.1 * (0.9 + 0.81 + 0.729))
    assert prediction_coeff("momentum", 0.1, 1.0, 4) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="integer"):
        prediction_coeff("momentum", 0.1, 0.9, 1.5)
    with pytest.raises(ValueError, match="mode"):
        prediction_coeff("quadratic", 0.1, 0.9, 1)
    with pytest.raises(ValueError, match=">= 0"):
        prediction_coeff("linear", 0.1, 0.9, -1)


def test_momentum_prediction_h1_is_nesterov_lookahead():
    lr, m = 0.05, 0.9
    w0 = torch.randn(64, generator=torch.Generator().manual_seed(9))
    grads = _grads(64, 5, seed=10)
    w, buf = w0.clone(), torch.zeros(64)
    pred = torch.empty(64)
    for i, g in enumerate(grads):
        sgd_update(w, g, buf, lr=lr, momentum=m, dampening=0.0, weight_decay=0.0,
                   nesterov=False, maximize=False, init_momentum=i == 0,
                   predicted=pred, predict_coeff=prediction_coeff("momentum", lr, m, 1))
        torch.testing.assert_close(pred, w - lr * m * buf, rtol=0, atol=1e-6)
    # and the look-ahead is where the weights go if the next gradient is zero
    w_next = w.clone()
    sgd_update(w_next, torch.zeros(64), buf.clone(), lr=lr, momentum=m, dampening=0.0,
               weight_decay=0.0, nesterov=False, maximize=False, init_momentum=False)
    torch.testing.assert_close(pred, w_next, rtol=0, atol=1e-6)


def test_linear_prediction_and_predict_agree():
    lr, m, horizon = 0.05, 0.9, 3
    w, buf = torch.randn(50), torch.zeros(50)
    pred = torch.empty(50)
    coeff = prediction_coeff("linear", lr, m, horizon)
    sgd_update(w, torch.randn(50), buf, lr=lr, momentum=m, dampening=0.0, weight_decay=0.0,
               nesterov=False, maximize=False, init_momentum=True, predicted=pred,
               predict_coeff=coeff)
    assert torch.equal(pred, predict(w, buf, coeff))
    torch.testing.assert_close(pred, w - lr * horizon * buf)


def test_prediction_without_momentum_uses_gradient():
    w, g = torch.randn(20), torch.randn(20)
    w_old = w.clone()
    pred = torch.empty(20)
    sgd_update(w, g, None, lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0,
               nesterov=False, maximize=False, init_momentum=True, predicted=pred,
               predict_coeff=0.2)
    torch.testing.assert_close(w, w_old - 0.1 * g)
    torch.testing.assert_close(pred, w - 0.2 * g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_param_is_fp32_math_rounded_once(dtype):
    w32 = torch.randn(200).to(dtype).float()
    g = torch.randn(200).to(dtype)
    buf32 = torch.randn(200)
    w, buf = w32.to(dtype), buf32.clone()
    pred, delta = torch.empty(200, dtype=dtype), torch.zeros(200)
    kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=1e-2, nesterov=True,
              maximize=False, init_momentum=False)
    sgd_update(w32, g.float(), buf32, **kw)
    sgd_update(w, g, buf, predicted=pred, predict_coeff=0.3, delta=delta, delta_gamma=0.5, **kw)
    assert w.dtype == dtype
    assert torch.equal(w, w32.to(dtype))
    assert torch.equal(buf, buf32)
    assert torch.equal(pred, predict(w, buf, 0.3))


def test_sgd_delta_follows_pipemare_recursion():
    gamma = 0.1 ** (1 / 3)
    w, buf, delta = torch.randn(30), torch.zeros(30), torch.zeros(30)
    expected = torch.zeros(30, dtype=torch.float64)
    for i, g in enumerate(_grads(30, 6, seed=11)):
        w_old = w.clone()
        sgd_update(w, g, buf, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0,
                   nesterov=False, maximize=False, init_momentum=i == 0, delta=delta,
                   delta_gamma=gamma)
        expected = gamma * expected + (1 - gamma) * (w.double() - w_old.double())
        torch.testing.assert_close(delta.double(), expected, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- AMP


def test_found_inf_skips_everything():
    w, buf, delta, pred = torch.randn(40), torch.randn(40), torch.randn(40), torch.randn(40)
    before = [t.clone() for t in (w, buf, delta, pred)]
    sgd_update(w, torch.randn(40), buf, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.1,
               nesterov=False, maximize=False, init_momentum=False, predicted=pred,
               predict_coeff=0.1, delta=delta, delta_gamma=0.5,
               grad_scale=torch.tensor(8.0), found_inf=torch.tensor(1.0))
    for a, b in zip((w, buf, delta, pred), before, strict=True):
        assert torch.equal(a, b)

    w, m, v, vmax, last = (torch.rand(40) for _ in range(5))
    step = torch.tensor(4.0)
    before = [t.clone() for t in (w, m, v, vmax, last)]
    adam_update(w, torch.randn(40), m, v, vmax, step=step, lr=1e-3, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.1, decoupled=True, amsgrad=True, maximize=False,
                last_update=last, found_inf=torch.tensor([1.0]))
    assert step.item() == 4.0
    for a, b in zip((w, m, v, vmax, last), before, strict=True):
        assert torch.equal(a, b)


def test_grad_scale_unscales():
    w0, g = torch.randn(40), torch.randn(40)
    kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.1, nesterov=False,
              maximize=False, init_momentum=True)
    w1, w2 = w0.clone(), w0.clone()
    sgd_update(w1, g, torch.zeros(40), **kw)
    sgd_update(w2, g * 1024, torch.zeros(40), grad_scale=torch.tensor(1024.0),
               found_inf=torch.tensor(0.0), **kw)
    assert torch.equal(w1, w2)  # power-of-two scale: exact
    s1, s2 = torch.tensor(0.0), torch.tensor(0.0)
    a1, a2 = w0.clone(), w0.clone()
    akw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False,
               amsgrad=False, maximize=False)
    adam_update(a1, g, torch.zeros(40), torch.zeros(40), None, step=s1, **akw)
    adam_update(a2, g * 256, torch.zeros(40), torch.zeros(40), None, step=s2,
                grad_scale=torch.tensor(256.0), **akw)
    assert torch.equal(a1, a2) and s2.item() == 1.0


# --------------------------------------------------------------------------- Adam mitigations


def _slow_adam(w, grads, *, lr, b1, b2, eps, wd, decoupled, amsgrad, delay, horizon):
    """ALGORITHMS.md transcribed per element in float64 (Python floats)."""
    n = len(w)
    w = [float(x) for x in w]
    u, s, smax = [0.0] * n, [0.0] * n, [0.0] * n
    preds, lasts = [], []
    for t, g in enumerate(grads, start=1):
        g = [float(x) for x in g]
        pred, last = [0.0] * n, [0.0] * n
        for i in range(n):
            w_old = w[i]
            gi = g[i]
            wi = w[i]
            if wd:
                if decoupled:
                    wi = wi * (1 - lr * wd)
                else:
                    gi = gi + wd * wi
            u[i] = b1 * u[i] + (1 - b1) * gi
            s[i] = b2 * s[i] + (1 - b2) * gi * gi
            smax[i] = max(smax[i], s[i])
            u_hat = u[i] / (1 - b1**t)
            s_hat = (smax[i] if amsgrad else s[i]) / (1 - b2**t)
            if delay:
                numer = b1**delay * u_hat + (1 - b1**delay) * gi
            else:
                numer = u_hat
            wi = wi - lr * numer / (math.sqrt(s_hat) + eps)
            w[i] = wi
            last[i] = w_old - wi
            pred[i] = wi - horizon * last[i]
        preds.append(pred)
        lasts.append(last)
    return w, preds, lasts


@pytest.mark.parametrize(
    "decoupled,amsgrad,wd,delay",
    [(False, False, 0.0, 1), (False, False, 1e-2, 3), (True, True, 1e-1, 2), (True, False, 0.0, 0)],
)
def test_adam_sc_and_prediction_match_slow_reference(decoupled, amsgrad, wd, delay):
    n, steps, horizon = 7, 12, 2.0
    lr, b1, b2, eps = 1e-2, 0.9, 0.99, 1e-8
    w0 = torch.randn(n, generator=torch.Generator().manual_seed(12))
    grads = _grads(n, steps, seed=13)
    w, m, v, vmax = w0.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    step, last, pred = torch.tensor(0.0), torch.empty(n), torch.empty(n)
    exp_w, exp_preds, exp_lasts = _slow_adam(w0.tolist(), [g.tolist() for g in grads], lr=lr,
                                             b1=b1, b2=b2, eps=eps, wd=wd, decoupled=decoupled,
                                             amsgrad=amsgrad, delay=delay, horizon=horizon)
    for k, g in enumerate(grads):
        adam_update(w, g, m, v, vmax, step=step, lr=lr, beta1=b1, beta2=b2, eps=eps,
                    weight_decay=wd, decoupled=decoupled, amsgrad=amsgrad, maximize=False,
                    sc_delay=delay, last_update=last, predicted=pred, predict_horizon=horizon)
        torch.testing.assert_close(last.double(), torch.tensor(exp_lasts[k], dtype=torch.float64),
                                   rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(pred.double(), torch.tensor(exp_preds[k], dtype=torch.float64),
                                   rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.double(), torch.tensor(exp_w, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


def test_adam_sc_first_step_numerator_is_the_gradient():
    """At t = 1 the bias-corrected SC numerator is exactly g, so every D gives plain Adam's
    first step (which is lr * sign(g) up to eps)."""
    g = torch.randn(16, generator=torch.Generator().manual_seed(14))
    outs = []
    for delay in (0, 1, 4):
        w = torch.zeros(16)
        adam_update(w, g, torch.zeros(16), torch.zeros(16), None, step=torch.tensor(0.0),
                    lr=0.1, beta1=0.9, beta2=0.999, eps=1e-12, weight_decay=0.0,
                    decoupled=False, amsgrad=False, maximize=False, sc_delay=delay)
        outs.append(w)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(outs[2], outs[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(outs[0], -0.1 * g.sign(), rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- validation


def test_errors_name_the_tensor():
    w = torch.randn(10)
    kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
              maximize=False, init_momentum=False)
    with pytest.raises(ValueError, match="grad has shape"):
        sgd_update(w, torch.randn(11), torch.zeros(10), **kw)
    with pytest.raises(TypeError, match="momentum_buffer must be torch.float32"):
        sgd_update(w, torch.randn(10), torch.zeros(10, dtype=torch.float64), **kw)
    with pytest.raises(ValueError, match="momentum_buffer is required"):
        sgd_update(w, torch.randn(10), None, **kw)
    with pytest.raises(TypeError, match="predicted must be torch.float32"):
        sgd_update(w, torch.randn(10), torch.zeros(10), predicted=torch.zeros(10).half(), **kw)
    with pytest.raises(TypeError, match="param must be"):
        sgd_update(w.int(), torch.randn(10), torch.zeros(10), **kw)
    with pytest.raises(TypeError, match="momentum_buffer must be torch.float64"):
        sgd_update(w.double(), torch.randn(10), torch.zeros(10), **kw)  # fp64 keeps fp64 state
    with pytest.raises(ValueError, match="max_exp_avg_sq is required"):
        adam_update(w, torch.randn(10), torch.zeros(10), torch.zeros(10), None,
                    step=torch.tensor(0.0), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.0, decoupled=False, amsgrad=True, maximize=False)
    with pytest.raises(TypeError, match="step must be"):
        adam_update(w, torch.randn(10), torch.zeros(10), torch.zeros(10), None,
                    step=torch.tensor(0), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.0, decoupled=False, amsgrad=False, maximize=False)


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_spike_compensation_keeps_the_total_contribution_with_dampening(delay: int) -> None:
    """ALGORITHMS.md: a gradient's total contribution over time is lr (1 - d) / (1 - m) with
    and without spike compensation; the spike term carries the (1 - d) that makes it so."""
    m, d, lr = 0.8, 0.3, 0.1
    w = torch.zeros(4)
    buf = torch.zeros(4)
    g = torch.tensor([1.0, -2.0, 0.5, 3.0])
    sgd_update(w, torch.zeros(4), buf, lr=lr, momentum=m, dampening=d,
               weight_decay=0.0, nesterov=False, maximize=False, init_momentum=True,
               sc_delay=delay, validate=False)
    for t in range(400):
        sgd_update(w, g if t == 0 else torch.zeros(4), buf, lr=lr,
                   momentum=m, dampening=d, weight_decay=0.0, nesterov=False, maximize=False,
                   init_momentum=False, sc_delay=delay, validate=False)
    torch.testing.assert_close(w, -lr * (1 - d) / (1 - m) * g, rtol=1e-5, atol=1e-6)
