"""Fused NAdam/NAdamW kernel (triton_kernels.nadam) against the reference math, under the
interpreter (compiled on a GPU), with the tolerances of tests/kernel_support.py.

Each case runs three steps from identical inputs, then resets the kernel's tensors to the
reference's so rounding differences cannot compound; the scalar state (step, mu_product) must
agree bit for bit, since the launcher advances it with the reference's ops.
"""

from __future__ import annotations

import pytest
import torch
from kernel_support import DEVICE, _on_device, assert_kernel_close  # noqa: F401 (autouse fixture)
from kernel_support import randn as _randn

from engine.optim.functional_nadam import nadam_update
from engine.triton_kernels import launch_nadam

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 127]
BIG = 65537  # more than one interpreter block, ragged tail
BASE = dict(lr=1e-2, beta1=0.99, beta2=0.999, eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
            decoupled=False, maximize=False)
CASES = {
    "nadam": dict(),
    "nadam_wd": dict(weight_decay=1e-2),
    "nadamw": dict(weight_decay=1e-1, decoupled=True),
    "maximize": dict(maximize=True, beta1=0.3),  # torch's other lerp branch
    "predict_delta": dict(pred=True, last=True, delta=True, decoupled=True, weight_decay=1e-2),
    "amp": dict(scale=True, pred=True, delta=True),
    "host": dict(host=True, scale=True, delta=True, weight_decay=1e-2),  # torch's CPU layout
    # delay compensation: |dc_coeff * g * delta| ~ 5% of g (delta ~ 1e-3)
    "dc": dict(delta=True, dc_coeff=50.0, decoupled=True, weight_decay=1e-2, maximize=True),
    "dc_host": dict(host=True, delta=True, dc_coeff=50.0, scale=True, weight_decay=1e-2),
}
STATE = ("exp_avg", "exp_avg_sq")


def _make(n, dtype, case, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return {
        "param": _randn(n, gen).to(dtype),
        "exp_avg": torch.zeros(n),
        "exp_avg_sq": torch.zeros(n),
        "mu_product": torch.ones(()),
        "step": torch.zeros(()),
        "last_update": torch.zeros(n) if case.get("last") else None,
        "predicted": torch.full((n,), 123.0, dtype=dtype) if case.get("pred") else None,
        "delta": _randn(n, gen) * 1e-3 if case.get("delta") else None,
    }


def _run_case(n, dtype, case, block=None, steps=3):
    ref = _make(n, dtype, case, seed=n)
    fused = {k: (v.clone() if v is not None else None) for k, v in ref.items()}
    gen = torch.Generator(device="cpu").manual_seed(n + 1)
    scale = torch.tensor(512.0)
    kw = {k: v for k, v in {**BASE, **case}.items()
          if k not in ("pred", "last", "delta", "scale", "host")}
    kw.update(predict_horizon=2.0, delta_gamma=0.1 ** 0.5)
    if case.get("scale"):
        kw.update(grad_scale=scale, found_inf=torch.tensor(0.0))
    for _ in range(steps):
        g = _randn(n, gen).to(dtype)
        if case.get("scale"):
            g = (g.float() * scale).to(dtype)
        before = ref["param"].clone()
        for t, fn in ((ref, nadam_update), (fused, launch_nadam)):
            extra = {"block": block, "device_step": not case.get("host")} if fn is launch_nadam else {}
            fn(t["param"], g, t["exp_avg"], t["exp_avg_sq"], t["mu_product"], step=t["step"],
               last_update=t["last_update"], predicted=t["predicted"], delta=t["delta"],
               **kw, **extra)
        for name, r in ref.items():
            if r is None:
                continue
            if name in ("step", "mu_product"):
                assert torch.equal(fused[name], r), name
            elif name in STATE:
                assert_kernel_close(name, fused[name], r, torch.float32)
            elif name in ("last_update", "delta", "predicted"):
                assert_kernel_close(name, fused[name], r, dtype, w=ref["param"])
            else:
                assert_kernel_close(name, fused[name], r, dtype, w=before)
            fused[name].copy_(r)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_fused_nadam_matches_reference(case, dtype, n):
    _run_case(n, dtype, CASES[case])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["predict_delta", "dc"])
def test_fused_nadam_matches_reference_big(case, dtype):
    _run_case(BIG, dtype, CASES[case], steps=2)


def test_fused_nadam_many_programs():
    _run_case(1023, torch.float32, CASES["amp"], block=128)


@pytest.mark.parametrize("host", [False, True])
def test_found_inf_writes_nothing(host):
    t = _make(100, torch.float32, CASES["predict_delta"], seed=3)
    t["exp_avg"].normal_()
    before = {k: v.clone() for k, v in t.items() if v is not None}
    launch_nadam(t["param"], torch.randn(100), t["exp_avg"], t["exp_avg_sq"], t["mu_product"],
                 step=t["step"], last_update=t["last_update"], predicted=None, delta=t["delta"],
                 grad_scale=torch.tensor(2.0), found_inf=torch.tensor(1.0), device_step=not host,
                 **{**BASE, "decoupled": True, "weight_decay": 0.1})
    for k, v in before.items():
        assert torch.equal(t[k], v), k


def test_bad_tensor_is_refused_before_anything_changes():
    t = _make(10, torch.float32, {}, seed=4)
    step = t["step"].clone()
    with pytest.raises(TypeError, match="mu_product"):
        launch_nadam(t["param"], torch.randn(10), t["exp_avg"], t["exp_avg_sq"],
                     torch.ones((), dtype=torch.float64), step=t["step"], **BASE)
    assert torch.equal(t["step"], step)
