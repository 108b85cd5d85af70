"""engine.optim.NAdam: torch.optim.NAdam bit for bit at delay 0, the formulas of
docs/ALGORITHMS.md ("NAdam for asynchronous pipelines") against a slow elementwise reference,
AsyncPP's per-stage beta1, the fused path, option checks, and state_dict crossing."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.optim.nadam as torch_nadam
from kernel_support import DEVICE, needs_kernels

import engine.optim as eo
from engine.optim.functional_nadam import stage_beta1

DTYPES = [torch.float32, torch.float64, torch.complex64]
CONFIGS = [
    {},
    {"weight_decay": 0.1},
    {"weight_decay": 0.1, "decoupled_weight_decay": True, "betas": (0.99, 0.999)},  # AsyncPP's
    {"maximize": True, "momentum_decay": 0.0, "betas": (0.3, 0.9)},
]
FLAGS = [{}, {"foreach": True}, {"differentiable": True}, {"lr": torch.tensor(0.01)}]
STEPS = 5


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g).to(dtype), torch.randn(5, generator=g).to(dtype)]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype).to(p.device)
        opt.step()


def _pair(dtype, kw):
    # foreach never changes our result; torch's foreach NAdam rounds differently from its
    # single-tensor path (the one we follow op for op), so compare with that one
    a, b = _params(dtype), _params(dtype)
    theirs_kw = {k: v for k, v in kw.items() if k != "foreach"}
    return a, b, eo.NAdam(a, **kw), torch.optim.NAdam(b, **theirs_kw)


def _assert_equal(a, b, what):
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"{what}: tensor {i} differs by {(x - y).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: ",".join(f) or "default")
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(c) or "plain")
def test_equals_torch_nadam_bitwise(cfg, flags, dtype):
    a, b, ours, theirs = _pair(dtype, {"lr": 0.01, **cfg, **flags})
    _run(ours, a, STEPS)
    _run(theirs, b, STEPS)
    _assert_equal(a, b, f"{cfg} {flags}")
    for x, y in zip(a, b, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "mu_product", "step"):
            assert torch.equal(ours.state[x][key].cpu(), theirs.state[y][key]), key


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_capturable_equals_torch_capturable(dtype, monkeypatch):
    # torch refuses capturable on CPU (a device check, not the math): let its path run here
    monkeypatch.setattr(torch_nadam, "_get_capturable_supported_devices", lambda *a, **k: ["cpu"])
    a, b, ours, theirs = _pair(dtype, {"lr": 0.01, "capturable": True, "weight_decay": 0.1})
    _run(ours, a, STEPS)
    _run(theirs, b, STEPS)
    _assert_equal(a, b, "capturable")


@pytest.mark.parametrize("direction", ["torch->engine", "engine->torch"])
def test_state_dict_crosses_over_and_keeps_stepping(direction):
    a, b, ours, theirs = _pair(torch.float32, {"lr": 0.01, "weight_decay": 0.1,
                                               "decoupled_weight_decay": True})
    _run(ours, a, 3)
    _run(theirs, b, 3)
    if direction == "torch->engine":
        fresh = eo.NAdam(a, lr=0.5)
        fresh.load_state_dict(theirs.state_dict())
        ours = fresh
    else:
        fresh = torch.optim.NAdam(b, lr=0.5)
        # a copy: torch loads step and mu_product without copying them (shared tensors)
        fresh.load_state_dict(copy.deepcopy(ours.state_dict()))
        theirs = fresh
    _run(ours, a, 3, seed=2)
    _run(theirs, b, 3, seed=2)
    _assert_equal(a, b, direction)


def test_stage_beta1_is_asyncpp_rule_and_equals_torch_with_that_beta1():
    # AsyncPP: beta1 + (V_s - 1) * (0.99 - beta1) / S; under stashing V_s - 1 = D_s
    assert stage_beta1(0.9, 0.99, 4, 3) == 0.9 + 3 * (0.99 - 0.9) / 4
    for delay in range(4):
        a, b = _params(torch.float32), _params(torch.float32)
        ours = eo.NAdam(a, lr=0.01, delay=delay, stage_beta1=(0.99, 4))
        theirs = torch.optim.NAdam(b, lr=0.01, betas=(stage_beta1(0.9, 0.99, 4, delay), 0.999))
        _run(ours, a, 3)
        _run(theirs, b, 3)
        _assert_equal(a, b, f"delay {delay}")


def _slow_nadam(w, grads, *, lr, beta1, beta2, eps, wd, psi, decoupled, horizon, gamma):
    """docs/ALGORITHMS.md's NAdam (Dozat's schedule, torch's form), elementwise in Python
    floats, with the linear prediction w - H * (w_old - w) and PipeMare's delta."""
    w = [float(x) for x in w]
    m = [0.0] * len(w)
    v = [0.0] * len(w)
    delta = [0.0] * len(w)
    prod = 1.0
    pred = None
    for t, g in enumerate(grads, start=1):
        mu = beta1 * (1 - 0.5 * 0.96 ** (t * psi))
        mu_next = beta1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
        prod = float(torch.tensor(prod * mu, dtype=torch.float32))  # fp32 state, as torch
        old = list(w)
        pred = []
        for i, gi in enumerate(float(x) for x in g):
            if decoupled:
                w[i] *= 1 - lr * wd
            else:
                gi += wd * old[i]
            m[i] = beta1 * m[i] + (1 - beta1) * gi
            v[i] = beta2 * v[i] + (1 - beta2) * gi * gi
            denom = math.sqrt(v[i] / (1 - beta2**t)) + eps
            w[i] -= lr * ((1 - mu) / (1 - prod) * gi + mu_next / (1 - prod * mu_next) * m[i]) / denom
            delta[i] = gamma * delta[i] + (1 - gamma) * (w[i] - old[i])
            pred.append(w[i] - horizon * (old[i] - w[i]))
    return w, pred, delta


@pytest.mark.parametrize("decoupled", [False, True])
def test_formula_against_slow_reference(decoupled):
    delay, S = 2, 4
    p = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    q = p.clone()
    opt = eo.NAdam([q], lr=0.02, weight_decay=0.1, decoupled_weight_decay=decoupled, delay=delay,
                   stage_beta1=(0.99, S), prediction="linear", discrepancy_correction=True,
                   correction_decay=0.1)
    grads = [torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + i))
             for i in range(4)]
    for g in grads:
        q.grad = g
        opt.step()
    w, pred, delta = _slow_nadam(p, grads, lr=0.02, beta1=stage_beta1(0.9, 0.99, S, delay),
                                 beta2=0.999, eps=1e-8, wd=0.1, psi=4e-3, decoupled=decoupled,
                                 horizon=delay, gamma=0.1 ** (1 / delay))
    torch.testing.assert_close(q, torch.tensor(w, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(opt.state[q]["delta"], torch.tensor(delta, dtype=torch.float64),
                               rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(q - delay * opt.state[q]["last_update"],
                               torch.tensor(pred, dtype=torch.float64), rtol=1e-9, atol=1e-9)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fused_optimizer_matches_reference(dtype):
    kw = dict(lr=0.01, betas=(0.99, 0.999), weight_decay=0.1, decoupled_weight_decay=True,
              delay=2, prediction="linear", discrepancy_correction=True)
    a = [p.to(DEVICE) for p in _params(dtype)]
    b = [p.to(DEVICE) for p in _params(dtype)]
    ref, fused = eo.NAdam(a, fused=False, **kw), eo.NAdam(b, fused=True, **kw)
    _run(ref, a, 3)
    _run(fused, b, 3)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, **tol)
        assert torch.equal(fused.state[y]["mu_product"], ref.state[x]["mu_product"])


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"spike_compensation": True}, "spike_compensation=True is not available for NAdam"),
        ({"prediction": "momentum"}, "prediction='momentum' is not available for NAdam"),
        ({"momentum_decay": -1.0}, "momentum_decay"),
        ({"stage_beta1": (0.99,)}, r"stage_beta1=\(0.99,\) is invalid"),
        ({"stage_beta1": (1.0, 4)}, "beta1_max must lie in"),
        ({"stage_beta1": (0.99, 0)}, "num_stages be >= 1"),
        ({"stage_beta1": (0.99, 2), "delay": 30}, "gives beta1="),
        ({"betas": (torch.tensor(0.9), torch.tensor(0.999))}, "NAdam takes betas as floats"),
    ],
)
def test_bad_options_are_refused(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        eo.NAdam(_params(torch.float32), **kw)


def test_bad_group_edit_is_refused_before_anything_changes():
    a = _params(torch.float32)
    opt = eo.NAdam(a, lr=0.01, stage_beta1=(0.99, 4))
    _run(opt, a, 1)
    before = [p.clone() for p in a]
    state = {k: v.clone() for k, v in opt.state[a[0]].items()}
    opt.param_groups[0]["delay"] = 100  # beta1_s would exceed 1
    with pytest.raises(ValueError, match="delay=100"):
        opt.step()
    _assert_equal(a, before, "weights after a refused step")
    for k, v in state.items():
        assert torch.equal(opt.state[a[0]][k], v), k
