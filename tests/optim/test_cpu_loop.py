"""SGD's fused CPU loop (csrc/sgd_cpu.cpp via engine.optim.cpu_loop) against the reference.

The contract is bitwise: the loop rounds every multiply-add as torch's CPU kernel for the
reference's op rounds it (fused on AVX2/AVX512, product then sum on the DEFAULT capability),
so every comparison here is ``torch.equal``.
"""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import engine.optim as eo
from engine import arena
from engine.optim import cpu_loop, functional

ROOT = Path(__file__).resolve().parents[2]


GRAIN = 32768  # the loop's at::parallel_for grain
MOMENTUM_MODES = ("none", "plain", "nesterov", "spike1", "spike3")


def test_the_loop_is_built() -> None:
    # no skip: a stale extension would silently run every SGD step on the reference path
    assert cpu_loop.available(), (
        "engine._C has no sgd_step_cpu: rebuild it (PE_BUILD_CUDA=0 python setup.py build_ext "
        "--inplace, or pip install --no-build-isolation -e .)"
    )
    assert cpu_loop.variant() in ("fma", "baseline")


@functools.lru_cache(maxsize=4)  # inputs only: every use clones them
def _tensors(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(n, generator=g) for k in ("w", "g", "v", "d", "p")}


def _kwargs(mode: str, *, damp: float, wd: float, maximize: bool, init: bool) -> dict:
    momentum = 0.0 if mode == "none" else 0.9
    return dict(lr=0.1, momentum=momentum, dampening=0.0 if mode == "nesterov" else damp,
                weight_decay=wd, nesterov=mode == "nesterov", maximize=maximize,
                init_momentum=init, sc_delay={"spike1": 1, "spike3": 3}.get(mode, 0))


def _both(n: int, seed: int, kw: dict, pred: bool, delta: bool, scale: bool) -> list[tuple]:
    """(w, v, delta, predicted) after one reference update and one loop update."""
    base = _tensors(n, seed)
    grad_scale = torch.tensor(1024.0) if scale else None
    grad = base["g"] * 1024 if scale else base["g"]
    out = []
    for fn in (functional.sgd_update, cpu_loop.sgd_update):
        t = {k: v.clone() for k, v in base.items()}
        ran = fn(t["w"], grad, t["v"] if kw["momentum"] else None, predicted=t["p"] if pred else None,
                 predict_coeff=0.3, delta=t["d"] if delta else None, delta_gamma=0.7,
                 grad_scale=grad_scale, **kw)
        assert ran is (True if fn is cpu_loop.sgd_update else None)
        out.append((t["w"], t["v"], t["d"], t["p"]))
    return out


def _assert_equal(out: list[tuple], what: str) -> None:
    for name, a, b in zip(("param", "momentum_buffer", "delta", "predicted"), *out, strict=True):
        assert torch.equal(a, b), f"{what}: {name} differs in {(a != b).sum().item()} elements"


@pytest.mark.parametrize("n", [1, 127])
def test_loop_equals_reference_every_option_small(n: int) -> None:
    # the full product of options: tails only (n < one AVX2 vector pair) and a short body
    for mode, damp, wd, maximize, init, pred, delta, scale in itertools.product(
        MOMENTUM_MODES, (0.0, 0.3), (0.0, 0.01), *[(False, True)] * 5
    ):
        kw = _kwargs(mode, damp=damp, wd=wd, maximize=maximize, init=init)
        _assert_equal(_both(n, n, kw, pred, delta, scale), f"n={n} {mode} {kw} pred={pred} delta={delta}")


@pytest.mark.parametrize("n", [65537, 3 * GRAIN + 5])
def test_loop_equals_reference_large(n: int) -> None:
    # every instantiated kernel (mode x init x pred x delta) across chunks and blocks; the
    # gradient preparation (scale, maximize, weight decay, dampening) cycles through its 16
    # combinations
    prep = itertools.cycle(itertools.product((False, True), (False, True), (0.0, 0.01), (0.0, 0.3)))
    for mode, init, pred, delta in itertools.product(MOMENTUM_MODES, *[(False, True)] * 3):
        scale, maximize, wd, damp = next(prep)
        kw = _kwargs(mode, damp=damp, wd=wd, maximize=maximize, init=init)
        _assert_equal(_both(n, 7, kw, pred, delta, scale), f"n={n} {mode} {kw} pred={pred} delta={delta}")


def test_baseline_variant_matches_default_capability() -> None:
    # ATEN_CPU_CAPABILITY=default: torch's kernels multiply then add; the loop follows
    script = (
        "import torch\n"
        "from engine.optim import cpu_loop, functional\n"
        "assert cpu_loop.variant() == 'baseline', cpu_loop.variant()\n"
        "for n in (127, 40000):\n"
        "    g = torch.Generator().manual_seed(n)\n"
        "    w, gr, v, p = (torch.randn(n, generator=g) for _ in range(4))\n"
        "    outs = []\n"
        "    for fn in (functional.sgd_update, cpu_loop.sgd_update):\n"
        "        ww, vv, pp = w.clone(), v.clone(), p.clone()\n"
        "        fn(ww, gr, vv, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01,\n"
        "           nesterov=False, maximize=False, init_momentum=False, sc_delay=3,\n"
        "           predicted=pp, predict_coeff=0.3)\n"
        "        outs.append((ww, vv, pp))\n"
        "    assert all(torch.equal(a, b) for a, b in zip(*outs)), n\n"
        "print('ok')\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_loop_skips_on_found_inf_and_leaves_everything() -> None:
    t = {k: v.clone() for k, v in _tensors(300, 1).items()}
    before = {k: v.clone() for k, v in t.items()}
    ran = cpu_loop.sgd_update(t["w"], t["g"], t["v"], lr=0.1, momentum=0.9, dampening=0.0,
                              weight_decay=0.0, nesterov=False, maximize=False,
                              init_momentum=False, sc_delay=2, predicted=t["p"],
                              predict_coeff=0.2, found_inf=torch.tensor(1.0))
    assert ran is True
    assert all(torch.equal(t[k], before[k]) for k in t)


def test_loop_refuses_tensors_it_cannot_read() -> None:
    from engine import _C

    w = torch.zeros(8)
    with pytest.raises(RuntimeError, match="momentum_buffer must be a contiguous float32"):
        _C.sgd_step_cpu(w, torch.zeros(8), torch.zeros(8, dtype=torch.float64), None, None,
                        lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                        maximize=False, init_momentum=False, spike=False, sc_a=1.0, sc_bd=0.0,
                        predict_coeff=0.0, delta_gamma=0.0, grad_scale=None)
    assert torch.equal(w, torch.zeros(8))


# --------------------------------------------------------------------------- the optimizer


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(33, 65), nn.Tanh(), nn.Linear(65, 7))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3, **step_kw) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 33, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step(**step_kw)


DELAY_CASES = {
    "sc": dict(delay=3, spike_compensation=True),
    "sc+lwp": dict(delay=3, spike_compensation=True, prediction="linear"),
    "lwp+delta": dict(delay=2, prediction="momentum", discrepancy_correction=True,
                      dampening=0.2, weight_decay=0.01, maximize=True),
    "delta, no momentum": dict(delay=2, discrepancy_correction=True, momentum=0.0),
}


@pytest.mark.parametrize("flat", [False, True], ids=["per-tensor", "flat"])
@pytest.mark.parametrize("case", list(DELAY_CASES))
def test_optimizer_loop_equals_reference_path(case: str, flat: bool, monkeypatch) -> None:
    kw = {"lr": 0.05, "momentum": 0.9, **DELAY_CASES[case]}
    runs = []
    for env in ("1", "0"):
        monkeypatch.setenv(cpu_loop.ENV, env)
        model = _model()
        if flat:
            arena.flatten_(model)
        opt = eo.SGD(model.parameters(), **kw)
        _train(model, opt, grad_scale=torch.tensor(2.0), found_inf=torch.tensor(0.0))
        runs.append((model, opt))
    (m1, o1), (m0, o0) = runs
    calls = 3 if flat else 3 * 4
    assert o1.update_paths == {"cpu_loop": calls, "reference": 0, "triton": 0}
    assert o0.update_paths == {"cpu_loop": 0, "reference": calls, "triton": 0}
    for p1, p0 in zip(m1.parameters(), m0.parameters(), strict=True):
        assert torch.equal(p1, p0)
        for key, value in o0.state[p0].items():
            assert torch.equal(o1.state[p1][key], value), key
    if "prediction" in kw:
        for a, b in zip(o1.predicted_weights(), o0.predicted_weights(), strict=True):
            assert torch.equal(a, b)


def test_plain_momentum_sgd_stays_on_torch_ops_and_equals_torch() -> None:
    model, ref = _model(), _model()
    opt = eo.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    _train(model, opt)
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01))
    assert opt.update_paths["cpu_loop"] == 0 and opt.update_paths["reference"] == 12
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_loop_leaves_what_it_cannot_serve_to_the_reference() -> None:
    # bf16 params and a non-contiguous param: the reference path, counted as such
    torch.manual_seed(0)
    half = nn.Parameter(torch.randn(5, 6, dtype=torch.bfloat16))
    strided = nn.Parameter(torch.randn(6, 5).t())
    opt = eo.SGD([half, strided], lr=0.1, momentum=0.9, delay=2, spike_compensation=True)
    half.grad, strided.grad = torch.ones_like(half), torch.ones_like(strided)
    opt.step()
    assert opt.update_paths == {"cpu_loop": 0, "reference": 2, "triton": 0}


def test_pb_batch1_pipeline_with_the_loop_equals_the_reference_path() -> None:
    """The pipeline end to end (pb, SC + LWP, flat stage buffers), as bench/overhead.py's
    ``pb-batch1-cpu-loop`` case checks it before timing (it also asserts the loop ran)."""
    from bench_support import load_bench

    assert load_bench("overhead").pb_batch1_loop_case().check() == "bitwise equal"


def test_delay_compensation_takes_the_reference_path() -> None:
    # DC's g + lambda * g * g * (tau * delta) is not in the loop: the reference computes it
    model = _model()
    opt = eo.SGD(model.parameters(), lr=0.05, momentum=0.9, delay=2, spike_compensation=True,
                 delay_compensation=0.5)
    _train(model, opt)
    assert opt.update_paths == {"cpu_loop": 0, "reference": 12, "triton": 0}
    assert all(torch.isfinite(p).all() for p in model.parameters())
