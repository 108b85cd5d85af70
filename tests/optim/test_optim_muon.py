"""engine.optim.Muon: torch.optim.Muon (2-D params) and torch.optim.AdamW (the others) bit for
bit at delay 0, over single tensors and over flat arena buckets; the formulas of
docs/ALGORITHMS.md ("Muon under delay") against a slow float64 reference; state_dict
crossing and round trips; option checks that change nothing."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

import engine.optim as eo
from engine.optim import functional_muon as fm

STEPS = 4
SHAPES = [(5, 3), (3, 7), (4, 4)]  # tall (NS runs on the transpose), wide, square
CONFIGS = [
    {"lr": 0.02},
    {"lr": 0.02, "nesterov": False, "weight_decay": 0.0},
    {"lr": 0.01, "momentum": 0.9, "adjust_lr_fn": "original", "ns_steps": 3},
    {"lr": 0.01, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.05},
    {"lr": torch.tensor(0.02), "nesterov": False, "adjust_lr_fn": "match_rms_adamw"},
]
ADAMW = {"adamw_lr": 0.01, "adamw_betas": (0.8, 0.95), "adamw_eps": 1e-8, "adamw_weight_decay": 0.1}


def _tensors(shapes, dtype=torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def _assert_equal(a, b, what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"{what}: tensor {i} differs by {(x - y).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_matrices_equal_torch_muon_bitwise(cfg, dtype):
    a, b = _tensors(SHAPES, dtype), _tensors(SHAPES, dtype)
    ours, theirs = eo.Muon(a, **cfg), torch.optim.Muon(b, **cfg)
    _run(ours, a, STEPS)
    _run(theirs, b, STEPS)
    _assert_equal(a, b, "weights")
    _assert_equal([ours.state[p]["momentum_buffer"] for p in a],
                  [theirs.state[p]["momentum_buffer"] for p in b], "momentum buffers")
    assert ours.state_dict()["state"][0].keys() == theirs.state_dict()["state"][0].keys()


@pytest.mark.parametrize("own_lr", [True, False], ids=["adamw_lr", "adamw_lr=None"])
def test_other_params_equal_torch_adamw_bitwise(own_lr):
    shapes = [(6,), (2, 3, 4), ()]  # a bias, a conv-like weight, a scalar gain
    a, b = _tensors(shapes), _tensors(shapes)
    kw = dict(ADAMW) if own_lr else {**ADAMW, "adamw_lr": None}
    ours = eo.Muon(a, lr=0.03, **kw)
    theirs = torch.optim.AdamW(b, lr=0.01 if own_lr else 0.03, betas=(0.8, 0.95), eps=1e-8,
                               weight_decay=0.1)
    _run(ours, a, STEPS)
    _run(theirs, b, STEPS)
    _assert_equal(a, b, "weights")
    assert ours.state_dict()["state"][0].keys() == theirs.state_dict()["state"][0].keys()


def test_use_muon_false_group_takes_adamw_for_matrices_too():
    a, b = _tensors(SHAPES + [(4,)]), _tensors(SHAPES + [(4,)])
    ours = eo.Muon([{"params": a[:2], "use_muon": False}, {"params": a[2:]}], lr=0.02, **ADAMW)
    adamw = torch.optim.AdamW(b[:2], lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    muon = torch.optim.Muon(b[2:3], lr=0.02)
    rest = torch.optim.AdamW(b[3:], lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for p, q in zip(a, b, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        for o in (ours, adamw, muon, rest):
            o.step()
    _assert_equal(a, b, "use_muon=False group vs AdamW, the other vs Muon/AdamW")
    assert set(ours.state[a[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(ours.state[a[2]]) == {"momentum_buffer"}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 1, bias=False))


def _train(model: nn.Module, opts, xs) -> None:
    for x in xs:
        for o in opts:
            o.zero_grad()
        model(x).sin().sum().backward()
        for o in opts:
            o.step()


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 7, generator=g) for _ in range(n)]


@pytest.mark.parametrize("delay_kw", [{}, {"delay": 2, "prediction": "linear", "discrepancy_correction": True}],
                         ids=["plain", "prediction+t2"])
def test_flat_bucket_equals_per_tensor_and_torch_pair(delay_kw):
    import engine.arena as arena

    cfg = dict(lr=0.02, weight_decay=0.1, **ADAMW)
    flat, per, ref = _model(), _model(), _model()
    arena.flatten_(flat)
    opt_f, opt_p = eo.Muon(flat.parameters(), **cfg, **delay_kw), eo.Muon(per.parameters(), **cfg, **delay_kw)
    sizes: list[int] = []
    original = opt_f._call_update
    opt_f._call_update = lambda fn, group, param, *rest: (sizes.append(param.numel()),
                                                          original(fn, group, param, *rest))
    matrices = [p for p in ref.parameters() if p.dim() == 2]
    others = [p for p in ref.parameters() if p.dim() != 2]
    torch_pair = [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1),
                  torch.optim.AdamW(others, lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)]
    xs = _batches(3)
    _train(flat, [opt_f], xs)
    _train(per, [opt_p], xs)
    _train(ref, torch_pair, xs)
    n_flat = arena.flat_buffers_for(list(flat.parameters())).param.numel()
    assert sizes == [n_flat] * 3  # one update call per step over the flat bucket
    _assert_equal(list(flat.parameters()), list(per.parameters()), "flat vs per tensor")
    _assert_equal(list(flat.parameters()), list(ref.parameters()), "flat vs torch Muon+AdamW")
    sf, sp = opt_f.state_dict()["state"], opt_p.state_dict()["state"]
    assert sf.keys() == sp.keys()
    for pid, entry in sp.items():
        assert entry.keys() == sf[pid].keys()
        for key, value in entry.items():
            assert torch.equal(sf[pid][key], value), (pid, key)
    _assert_equal(opt_f.predicted_weights(), opt_p.predicted_weights(), "predictions")
    _assert_equal(opt_f.backward_weights(), opt_p.backward_weights(), "backward weights")


def test_amp_arguments_unscale_and_skip():
    shapes = SHAPES + [(4,)]
    a, b, c = _tensors(shapes), _tensors(shapes), _tensors(shapes)
    opts = [eo.Muon(x, lr=0.02, prediction="linear", delay=1) for x in (a, b, c)]
    grads = _tensors(shapes, seed=9)
    for x, scale in ((a, 1.0), (b, 4.0)):  # 4 is a power of two: unscaling is exact
        for p, g in zip(x, grads, strict=True):
            p.grad = g * scale
    opts[0].step()
    opts[1].step(grad_scale=torch.tensor(4.0))
    _assert_equal(a, b, "grad_scale")
    for p, g in zip(c, grads, strict=True):
        p.grad = g
    before = [p.clone() for p in c]
    opts[2].step(found_inf=torch.tensor(1.0))
    _assert_equal(c, before, "found_inf")
    assert all(int(opts[2].state[p].get("step", 0)) == 0 for p in c)
    assert all(opts[2].state[p].get("momentum_buffer", torch.zeros(1)).abs().sum() == 0 for p in c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_params_compute_in_fp32_and_round_once(dtype):
    shapes = SHAPES + [(4,)]
    low = _tensors(shapes, dtype)
    high = [p.float() for p in low]
    grads = _tensors(shapes, dtype, seed=9)
    ours, ref = eo.Muon(low, lr=0.02, **ADAMW), eo.Muon(high, lr=0.02, **ADAMW)
    for p, q, g in zip(low, high, grads, strict=True):
        p.grad, q.grad = g, g.float()
    ours.step()
    ref.step()
    _assert_equal(low, [q.to(dtype) for q in high], "one rounding of the fp32 result")
    assert ours.state[low[0]]["momentum_buffer"].dtype == torch.float32
    assert ours.state[low[-1]]["exp_avg"].dtype == torch.float32


# --------------------------------------------------------------------------- slow reference


def _slow_ns(m: torch.Tensor, coeffs, steps: int, eps: float) -> torch.Tensor:
    """ALGORITHMS.md's Newton-Schulz in float64 (no bf16 rounding)."""
    a, b, c = coeffs
    x = m.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(x.norm().item(), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


def _slow_muon(w0, grads, *, lr, wd, mu, nesterov, fn, horizon, gamma):
    """Muon from ALGORITHMS.md, elementwise where it is elementwise, in float64."""
    w, buf = w0.clone(), torch.zeros_like(w0)
    rows, cols = w.shape
    scale = math.sqrt(max(1, rows / cols)) if fn == "original" else 0.2 * math.sqrt(max(rows, cols))
    delta = torch.zeros_like(w0)
    for g in grads:
        old = w.clone()
        for i in range(rows):
            for j in range(cols):
                buf[i, j] = mu * buf[i, j] + (1 - mu) * g[i, j]
        u = (1 - mu) * g + mu * buf if nesterov else buf
        o = _slow_ns(u, fm.NS_COEFFICIENTS, fm.NS_STEPS, fm.EPS)
        w = w * (1 - lr * wd) - lr * scale * o
        delta = gamma * delta + (1 - gamma) * (w - old)
    return w, buf, w - horizon * (old - w), delta


@pytest.mark.parametrize("nesterov,fn", [(True, "original"), (False, "match_rms_adamw")])
def test_formula_against_slow_reference(nesterov, fn, monkeypatch):
    # everything but Newton-Schulz's bf16 rounding, exactly: NS itself is the float64
    # reference here (its bf16 form is checked against it in the next test)
    monkeypatch.setattr(fm, "zeropower_via_newtonschulz", _slow_ns)
    delay, lr = 2, 0.02
    p = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    q = p.clone().requires_grad_()
    opt = eo.Muon([q], lr=lr, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=fn, delay=delay,
                  prediction="linear", discrepancy_correction=True)
    gen = torch.Generator().manual_seed(10)
    grads = [torch.randn(6, 4, dtype=torch.float64, generator=gen) for _ in range(3)]
    for g in grads:
        q.grad = g
        opt.step()
    w, buf, pred, delta = _slow_muon(p, grads, lr=lr, wd=0.1, mu=0.95, nesterov=nesterov, fn=fn,
                                     horizon=delay, gamma=0.1 ** (1 / delay))
    close = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(opt.state[q]["momentum_buffer"], buf, **close)
    now = q.detach()
    torch.testing.assert_close(now, w, **close)
    (got,) = opt.predicted_weights()
    torch.testing.assert_close(got, pred, **close)
    torch.testing.assert_close(opt.predicted_weights(horizon=5.0)[0],
                               now - 5.0 * opt.state[q]["last_update"], **close)
    torch.testing.assert_close(opt.state[q]["delta"], delta, **close)
    torch.testing.assert_close(opt.backward_weights()[0], now - delay * delta, **close)


@pytest.mark.parametrize("shape", [(6, 4), (4, 9), (8, 8)])
def test_newton_schulz_against_slow_reference(shape):
    m = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    o = fm.zeropower_via_newtonschulz(m, fm.NS_COEFFICIENTS, fm.NS_STEPS, fm.EPS)
    assert o.shape == m.shape and o.dtype == torch.bfloat16
    want = _slow_ns(m, fm.NS_COEFFICIENTS, fm.NS_STEPS, fm.EPS)
    # bf16 rounding moves entries by up to ~0.025 (measured over seeds and shapes); one step
    # fewer or a coefficient off by 10% moves them by > 0.1, which this tolerance would catch
    torch.testing.assert_close(o.double(), want, rtol=0, atol=0.04)
    assert (want - _slow_ns(m, (3.1, -4.775, 2.0315), 5, fm.EPS)).abs().max() > 0.08
    s = torch.linalg.svdvals(o.double())
    assert s.min() > 0.5 and s.max() < 1.5, s  # Keller Jordan's U S' V^T, S' ~ U(0.5, 1.5)
    # a positive scale is divided out: the prediction's "no new gradient" argument (docs)
    assert torch.equal(fm.zeropower_via_newtonschulz(4.0 * m, fm.NS_COEFFICIENTS, 5, fm.EPS), o)


# --------------------------------------------------------------------------- state_dict


@pytest.mark.parametrize("direction", ["torch->engine", "engine->torch"])
def test_state_dict_crosses_over_and_keeps_stepping(direction):
    a, b = _tensors(SHAPES), _tensors(SHAPES)
    ours, theirs = eo.Muon(a, lr=0.02), torch.optim.Muon(b, lr=0.02)
    _run(ours, a, 2)
    _run(theirs, b, 2)
    if direction == "torch->engine":
        ours = eo.Muon(a, lr=0.5)
        ours.load_state_dict(theirs.state_dict())
    else:
        theirs = torch.optim.Muon(b, lr=0.5)
        theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    _run(ours, a, 2, seed=2)
    _run(theirs, b, 2, seed=2)
    _assert_equal(a, b, direction)


def test_state_dict_round_trip_resumes_exactly():
    cfg = dict(lr=0.02, delay=1, prediction="linear", discrepancy_correction=True, **ADAMW)
    a, b = _model(), _model(seed=5)
    opt_a = eo.Muon(a.parameters(), **cfg)
    _train(a, [opt_a], _batches(2))
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    with torch.no_grad():
        for p, q in zip(b.parameters(), a.parameters(), strict=True):
            p.copy_(q)
    opt_b = eo.Muon(b.parameters(), lr=1.0)
    opt_b.load_state_dict(torch.load(buf, weights_only=False))
    assert opt_b.param_groups[0]["adamw_betas"] == (0.8, 0.95)
    xs = _batches(2, seed=7)
    _train(a, [opt_a], xs)
    _train(b, [opt_b], xs)
    _assert_equal(list(a.parameters()), list(b.parameters()), "resumed")
    _assert_equal(opt_a.predicted_weights(), opt_b.predicted_weights(), "predictions")


# --------------------------------------------------------------------------- bad options


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"spike_compensation": True}, "spike_compensation=True is not available for Muon"),
        ({"prediction": "momentum"}, "prediction='momentum' is not available for Muon"),
        ({"fused": True}, "fused=True is not available for Muon"),
        ({"ns_steps": 100}, r"ns_steps=100 is invalid"),
        ({"ns_coefficients": (1.0, 2.0)}, r"ns_coefficients=\(1.0, 2.0\) is invalid"),
        ({"adjust_lr_fn": "rms"}, "adjust_lr_fn='rms' is not supported"),
        ({"momentum": -0.1}, "momentum=-0.1 is invalid"),
        ({"eps": -1.0}, "eps=-1.0 is invalid"),
        ({"adamw_lr": -1.0}, "adamw_lr=-1.0 is invalid"),
        ({"adamw_betas": (0.9, 1.0)}, r"adamw_betas=\(0.9, 1.0\) is invalid"),
        ({"nesterov": 1}, "nesterov=1 is invalid"),
        ({"use_muon": None}, "use_muon=None is invalid"),
    ],
)
def test_bad_options_are_refused(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        eo.Muon(_tensors(SHAPES), **kw)


def test_complex_params_are_refused():
    with pytest.raises(TypeError, match=r"params\[1\] is torch.complex64"):
        eo.Muon([torch.randn(3, 3), torch.randn(3, 3, dtype=torch.complex64)])


def test_bad_group_edit_is_refused_before_anything_changes():
    a = _tensors(SHAPES + [(4,)])
    opt = eo.Muon(a, lr=0.02)
    _run(opt, a, 1)
    before = [p.clone() for p in a]
    state = copy.deepcopy(opt.state_dict()["state"])
    opt.param_groups[0]["adjust_lr_fn"] = "bogus"
    with pytest.raises(ValueError, match=r"param_groups\[0\]: adjust_lr_fn='bogus'"):
        opt.step()
    _assert_equal(a, before, "weights after a refused step")
    for pid, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, state[pid][key]), (pid, key)
