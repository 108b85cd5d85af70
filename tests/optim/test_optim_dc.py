"""Delay-compensated gradients (``delay_compensation``, ALGORITHMS.md): every family against a
slow float64 transcription of the docs, bitwise unchanged at lambda = 0 or delay 0, one delta
buffer shared with PipeMare T2, bad options refused before anything changes, and the
pipeline: the weights F and B read under pb + T2, pipedream and 2bw, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from schedules import STASHED
from test_runtime_support import make_pipe
from test_runtime_versions import check_versions, run
from torch import nn

import engine.optim as eo
from engine import PipelineConfigError

LAM, TAU, DECAY, STEPS = 2.0, 3, 0.1, 8


def _grads(n: int, seed: int) -> list[list[float]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).tolist() for _ in range(STEPS)]


def _slow(family: str, w: list[float], grads: list[list[float]], lam: float, **hp) -> tuple:
    """ALGORITHMS.md per element in float64: g <- g + lam * g * g * (tau * delta), delta as it
    stands before the step, then the family's update, then delta's EMA of the step."""
    gamma = DECAY ** (1.0 / TAU)
    n = len(w)
    w = list(w)
    delta, m, v = [0.0] * n, [0.0] * n, [0.0] * n
    lr, wd, sign = hp["lr"], hp.get("wd", 0.0), -1.0 if hp.get("maximize") else 1.0
    prod = 1.0
    for t, grad in enumerate(grads, start=1):
        b1, b2, eps, psi = hp.get("b1", 0.9), 0.999, 1e-8, 4e-3
        mu = b1 * (1 - 0.5 * 0.96 ** (t * psi))
        mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
        prod *= mu
        for i in range(n):
            g = sign * grad[i]
            g = g + lam * g * g * (TAU * delta[i])
            w_old = wi = w[i]
            if family == "sgd":
                g = g + wd * wi
                m[i] = g if t == 1 else hp["momentum"] * m[i] + g
                wi = wi - lr * m[i]
            else:
                if hp.get("decoupled"):
                    wi = wi * (1 - lr * wd)
                else:
                    g = g + wd * wi
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
                if family == "adam":
                    den = math.sqrt(v[i] / (1 - b2**t)) + eps
                    wi = wi - lr * m[i] / (1 - b1**t) / den
                else:  # nadam
                    den = math.sqrt(v[i] / (1 - b2**t)) + eps
                    wi = wi - lr * ((1 - mu) / (1 - prod) * g
                                    + mu_next / (1 - prod * mu_next) * m[i]) / den
            w[i] = wi
            delta[i] = gamma * delta[i] + (1 - gamma) * (wi - w_old)
    return w, delta


FAMILIES = {
    "sgd": (eo.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-2, maximize=True),
            dict(lr=0.05, momentum=0.9, wd=1e-2, maximize=True)),
    "adam": (eo.Adam, dict(lr=0.05, weight_decay=1e-2), dict(lr=0.05, wd=1e-2)),
    "adamw": (eo.AdamW, dict(lr=0.05, weight_decay=1e-1, maximize=True),
              dict(lr=0.05, wd=1e-1, decoupled=True, maximize=True)),
    "nadam": (eo.NAdam, dict(lr=0.05, weight_decay=1e-2, decoupled_weight_decay=True),
              dict(lr=0.05, wd=1e-2, decoupled=True)),
}


def _train(cls, kw, w0, grads, **extra):
    p = nn.Parameter(w0.clone())
    opt = cls([p], delay=TAU, correction_decay=DECAY, **kw, **extra)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    return p, opt


@pytest.mark.parametrize("t2", [False, True], ids=["own-delta", "t2"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_formula_matches_slow_reference(name: str, t2: bool) -> None:
    cls, kw, hp = FAMILIES[name]
    family = {"adamw": "adam"}.get(name, name)
    w0 = torch.randn(6, generator=torch.Generator().manual_seed(1))
    grads = _grads(6, seed=2)
    p, opt = _train(cls, kw, w0, grads, delay_compensation=LAM, discrepancy_correction=t2)
    want_w, want_delta = _slow(family, w0.tolist(), grads, LAM, **hp)
    torch.testing.assert_close(p.detach().double(), torch.tensor(want_w, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["delta"].double(),
                               torch.tensor(want_delta, dtype=torch.float64), rtol=1e-4, atol=1e-6)
    # the compensation is not vacuous: without it the weights differ far beyond the tolerance
    plain_w, _ = _slow(family, w0.tolist(), grads, 0.0, **hp)
    assert max(abs(a - b) for a, b in zip(plain_w, want_w, strict=True)) > 1e-3


@pytest.mark.parametrize("name", list(FAMILIES))
def test_off_is_bitwise_unchanged(name: str) -> None:
    cls, kw, _ = FAMILIES[name]
    w0 = torch.randn(33, generator=torch.Generator().manual_seed(3))
    grads = _grads(33, seed=4)
    for t2 in (False, True):
        ref, ref_opt = _train(cls, kw, w0, grads, discrepancy_correction=t2)
        off, off_opt = _train(cls, kw, w0, grads, discrepancy_correction=t2,
                              delay_compensation=0.0)
        assert torch.equal(off, ref)
        assert ref_opt.state[ref].keys() == off_opt.state[off].keys()
        for key, value in ref_opt.state[ref].items():
            assert torch.equal(off_opt.state[off][key], value), key
    # delay 0 (a pipeline's last stage): nothing to compensate, no delta kept
    p, q = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    a, b = cls([p], **kw), cls([q], delay_compensation=LAM, **kw)
    for g in grads:
        p.grad, q.grad = torch.tensor(g), torch.tensor(g)
        a.step()
        b.step()
    assert torch.equal(p, q) and "delta" not in b.state[q]


def test_one_delta_buffer_shared_with_t2() -> None:
    w0, grads = torch.randn(5), _grads(5, seed=5)
    p, opt = _train(eo.SGD, dict(lr=0.1, momentum=0.9), w0, grads, delay_compensation=LAM)
    assert sorted(opt.state[p]) == ["delta", "momentum_buffer"]  # its own delta, T2 off
    assert torch.equal(opt.backward_weights()[0], p.detach())  # ...which B does not read
    q, opt2 = _train(eo.SGD, dict(lr=0.1, momentum=0.9), w0, grads, delay_compensation=LAM,
                     discrepancy_correction=True)
    assert sorted(opt2.state[q]) == ["delta", "momentum_buffer"]  # one buffer for both
    assert torch.equal(q, p) and torch.equal(opt2.state[q]["delta"], opt.state[p]["delta"])
    torch.testing.assert_close(opt2.backward_weights()[0], q.detach() - TAU * opt2.state[q]["delta"])


def test_state_dict_round_trip_resumes_exactly() -> None:
    w0, grads = torch.randn(9), _grads(9, seed=6)
    kw = dict(lr=0.05, delay_compensation=LAM)
    full, _ = _train(eo.Adam, kw, w0, grads)
    half, opt = _train(eo.Adam, kw, w0, grads[:4])
    q = nn.Parameter(half.detach().clone())
    resumed = eo.Adam([q], delay=TAU, correction_decay=DECAY, **kw)
    resumed.load_state_dict(opt.state_dict())
    for g in grads[4:]:
        q.grad = torch.tensor(g)
        resumed.step()
    assert torch.equal(q, full)


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf"), True, "0.1", None])
@pytest.mark.parametrize("cls", [eo.SGD, eo.AdamW, eo.NAdam])
def test_bad_values_refused_before_anything_changes(cls, value) -> None:
    with pytest.raises(ValueError, match=r"delay_compensation=.* is invalid.*finite number >= 0"):
        cls([nn.Parameter(torch.ones(3))], lr=0.1, delay_compensation=value)
    p = nn.Parameter(torch.ones(3))
    opt = cls([p], lr=0.1, delay=2, delay_compensation=2.0)  # (not 1.0: True == 1.0)
    p.grad = torch.ones(3)
    opt.step()
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    opt.param_groups[0]["delay_compensation"] = value
    with pytest.raises(ValueError, match=r"param_groups\[0\]: delay_compensation="):
        opt.step()
    assert torch.equal(p, before[0])
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())


def test_complex_and_sparse_refused() -> None:
    with pytest.raises(TypeError, match=r"delay_compensation=1.0 needs real params.*complex64"):
        eo.Adam([nn.Parameter(torch.ones(2, dtype=torch.complex64))], delay_compensation=1.0)
    emb = nn.Embedding(4, 2, sparse=True)
    opt = eo.SGD(emb.parameters(), lr=0.1, delay=1, delay_compensation=1.0)
    emb(torch.tensor([1])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match="sparse gradient.*delay_compensation need dense"):
        opt.step()
    assert torch.equal(emb.weight, before)


# --------------------------------------------------------------------------- pipeline


def _sgd(**kw):
    return lambda p: eo.SGD(p, lr=0.05, momentum=0.9, **kw)


def test_pb_with_t2_reads_t2_weights_and_compensates() -> None:
    S, M = 3, 3
    pipe, got, hist, N = run(S, M, "pb", _sgd(discrepancy_correction=True, delay_compensation=LAM),
                             checkpoint="always")
    assert pipe.discrepancy_correction

    def b_value(s, tB, wf):  # the probe: DC changes no weight F or B reads (T2's w - tau * delta)
        d = hist.delta[s][tB]
        return hist.w[s][tB] if d is None else hist.w[s][tB] - pipe.delays[s] * d

    check_versions(pipe, got, hist, N, "pb", b_value=b_value)
    plain, *_ = run(S, M, "pb", _sgd(discrepancy_correction=True), checkpoint="always")
    moved = [not torch.equal(a.detach(), b.detach()) for a, b in
             zip(pipe.stages[0].module.parameters(), plain.stages[0].module.parameters(), strict=True)]
    assert all(moved)  # stage 0 (delay 4) took compensated gradients
    last = [torch.equal(a.detach(), b.detach()) for a, b in
            zip(pipe.stages[-1].module.parameters(), plain.stages[-1].module.parameters(), strict=True)]
    assert not all(last)  # (its gradients come from compensated upstream weights)


@pytest.mark.parametrize("schedule", STASHED)
def test_stashing_schedules_keep_their_own_delta(schedule: str) -> None:
    S, M = 3, 3
    pipe, got, hist, N = run(S, M, schedule, _sgd(delay_compensation=LAM))
    check_versions(pipe, got, hist, N, schedule)  # the stashed versions, as without DC
    for s, D in enumerate(pipe.delays):
        assert (hist.delta[s][-1] is not None) == (D > 0), (s, D)
    plain, *_ = run(S, M, schedule, _sgd())
    assert not torch.equal(hist.w[0][-1], plain.stages[0].module[0].weight.detach())
    losses = [float(pipe.step(torch.randn(M, 3), torch.randn(M, 1))) for _ in range(2)]
    assert all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize(
    "schedule,kw,message",
    [
        ("gpipe", dict(), "has no delay"),
        ("pb", dict(), "needs discrepancy_correction=True"),
        ("pb", dict(prediction="linear"), "needs discrepancy_correction=True"),
    ],
)
def test_pipeline_refuses_dc_without_a_lag(schedule: str, kw: dict, message: str) -> None:
    with pytest.raises(PipelineConfigError, match=rf"stage 0: delay_compensation=2.0.*{message}"):
        make_pipe(2, schedule, 2, _sgd(delay_compensation=LAM, **kw))


def test_dc_on_some_param_groups_only() -> None:
    def mixed(p):  # no DC for the probe weight, DC for the Linear layer
        return eo.SGD([{"params": p[:1]}, {"params": p[1:], "delay_compensation": LAM}], lr=0.05)

    with pytest.raises(PipelineConfigError, match="stage 0: delay_compensation=2.0.*has no delay"):
        make_pipe(2, "gpipe", 2, mixed)
    pipe, _, hist = make_pipe(2, "pipedream", 2, mixed)
    for _ in range(3):
        pipe.step(torch.randn(2, 3), torch.randn(2, 1))
    opt = pipe.stages[0].optimizer
    probe, rest = opt.param_groups[0]["params"][0], opt.param_groups[1]["params"]
    assert "delta" not in opt.state[probe] and all("delta" in opt.state[p] for p in rest)
