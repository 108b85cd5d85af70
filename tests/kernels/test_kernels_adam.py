"""Fused Adam/AdamW kernel (triton_kernels.adam) against the reference math, under the interpreter.

Each case runs three steps from identical inputs for kernel and reference, then resets the
kernel's tensors to the reference's so that rounding differences cannot compound: the fp32
moments are held to ~1e-6 relative, tensors derived from the stored weights (param,
predicted, last_update, delta) to one ulp of the param dtype (a difference of weights errs by
an ulp of the weights, so those use the weights' magnitude). Both bias-correction paths are
covered: in-kernel from the step tensor (step on the param's device) and host-computed
(torch's layout of a CPU step with GPU params, forced here with ``device_step=False``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_support import DEVICE, _on_device, assert_kernel_close  # noqa: F401 (autouse fixture)
from kernel_support import randn as _randn

from engine.optim.functional import adam_update
from engine.triton_kernels import launch_adam

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 127, 1023]
# 65537 (more than one interpreter block, ragged tail) for the combinations that switch on
# the most features; the full grid at that size would take minutes under the interpreter
BIG = 65537
BIG_CASES = ["adamw", "amsgrad", "sc4_adamw", "amp", "host_step", "dc"]
STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

BASE = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False,
            amsgrad=False, maximize=False)
CASES = {
    "adam": dict(),
    "adam_wd": dict(weight_decay=1e-2),
    "adamw": dict(weight_decay=1e-1, decoupled=True),
    "amsgrad": dict(amsgrad=True, weight_decay=1e-2),
    "maximize": dict(maximize=True, decoupled=True, weight_decay=1e-2),
    "low_beta1": dict(beta1=0.3),  # torch's other lerp branch
    "sc1": dict(sc_delay=1),
    "sc4_adamw": dict(sc_delay=4, decoupled=True, weight_decay=1e-2),
    "predict": dict(pred=True, last=True),
    "delta": dict(delta=True, amsgrad=True),
    "amp": dict(scale=True, pred=True, delta=True, sc_delay=2),
    "host_step": dict(host=True, weight_decay=1e-2, amsgrad=True, sc_delay=2, last=True),
    # delay compensation: |dc_coeff * g * delta| ~ 5% of g (delta ~ 1e-3)
    "dc": dict(delta=True, dc_coeff=50.0, weight_decay=1e-2, pred=True, last=True),
    "dc_adamw_host": dict(host=True, delta=True, dc_coeff=50.0, decoupled=True,
                          weight_decay=1e-1, maximize=True, scale=True),
}


def _make(n, dtype, case, seed, start_step):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return {
        "param": _randn(n, gen).to(dtype),
        "exp_avg": torch.zeros(n),
        "exp_avg_sq": torch.zeros(n),
        "max_exp_avg_sq": torch.zeros(n) if case.get("amsgrad") else None,
        "last_update": torch.zeros(n) if case.get("last") else None,
        "predicted": torch.full((n,), 123.0, dtype=dtype) if case.get("pred") else None,
        "delta": _randn(n, gen) * 1e-3 if case.get("delta") else None,
        # torch's layout for GPU params keeps step on the CPU: the host bias-correction path
        "step": torch.tensor(float(start_step), device="cpu" if case.get("host") else DEVICE),
    }


def _run_case(n, dtype, case, block=None, steps=3, start_step=0, grad_dtype=None):
    ref = _make(n, dtype, case, seed=n, start_step=start_step)
    fused = {k: (v.clone() if v is not None else None) for k, v in ref.items()}
    gen = torch.Generator(device="cpu").manual_seed(n + 1)
    scale = torch.tensor(512.0)
    kw = {k: v for k, v in {**BASE, **case}.items()
          if k not in ("pred", "last", "delta", "scale", "host")}
    kw["predict_horizon"] = 2.0
    kw["delta_gamma"] = 0.1 ** 0.5
    if case.get("scale"):
        kw["grad_scale"] = scale
        kw["found_inf"] = torch.tensor(0.0)
    for _ in range(steps):
        g = _randn(n, gen).to(grad_dtype or dtype)
        if case.get("scale"):
            g = (g.float() * scale).to(grad_dtype or dtype)
        args = lambda t: dict(  # noqa: E731
            step=t["step"], last_update=t["last_update"], predicted=t["predicted"],
            delta=t["delta"])
        before = ref["param"].clone()  # w_new = w - step may cancel: compare at w's scale
        adam_update(ref["param"], g, ref["exp_avg"], ref["exp_avg_sq"], ref["max_exp_avg_sq"],
                    **args(ref), **kw)
        launch_adam(fused["param"], g, fused["exp_avg"], fused["exp_avg_sq"],
                    fused["max_exp_avg_sq"], block=block,
                    device_step=False if case.get("host") else None, **args(fused), **kw)
        assert fused["step"].item() == ref["step"].item()
        for name, r in ref.items():
            if r is None or name == "step":
                continue
            if name in STATE:
                assert_kernel_close(name, fused[name], r, torch.float32)
            elif name in ("last_update", "delta", "predicted"):
                assert_kernel_close(name, fused[name], r, dtype, w=ref["param"])
            else:
                assert_kernel_close(name, fused[name], r, dtype, w=before)
            fused[name].copy_(r)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_fused_adam_matches_reference(case, dtype, n):
    _run_case(n, dtype, CASES[case])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", BIG_CASES, ids=str)
def test_fused_adam_matches_reference_big(case, dtype):
    _run_case(BIG, dtype, CASES[case])


@pytest.mark.parametrize("start_step", [0, 9, 10_000])
@pytest.mark.parametrize("host", [False, True])
def test_bias_correction_at_late_steps(start_step, host):
    # beta2**t for large t and 1 - beta2**t for small t are where fp32 would go wrong
    _run_case(513, torch.float32, dict(CASES["amsgrad"], host=host), start_step=start_step)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["adamw", "amp"])
def test_fp32_params_with_low_precision_grads(case, grad_dtype):
    # fp32 master weights fed half-precision gradients (AMP without a grad copy)
    _run_case(1023, torch.float32, CASES[case], grad_dtype=grad_dtype)


@pytest.mark.parametrize("case", ["adamw", "sc4_adamw", "amp"])
def test_fused_adam_many_programs(case):
    _run_case(1023, torch.float32, CASES[case], block=128)


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_found_inf_writes_nothing_and_keeps_step(dtype, host):
    n = 1000
    t = {
        "param": torch.randn(n).to(dtype), "exp_avg": torch.randn(n),
        "exp_avg_sq": torch.rand(n), "max_exp_avg_sq": torch.rand(n),
        "last_update": torch.randn(n), "predicted": torch.randn(n).to(dtype),
        "delta": torch.randn(n), "step": torch.tensor(7.0, device="cpu" if host else DEVICE),
    }
    before = {k: v.clone() for k, v in t.items()}
    launch_adam(t["param"], torch.randn(n).to(dtype), t["exp_avg"], t["exp_avg_sq"],
                t["max_exp_avg_sq"], step=t["step"], lr=1e-3, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=1e-2, decoupled=True, amsgrad=True, maximize=False,
                sc_delay=2, last_update=t["last_update"], predicted=t["predicted"],
                predict_horizon=2.0, delta=t["delta"], delta_gamma=0.5,
                grad_scale=torch.tensor(2.0), found_inf=torch.tensor([1.0]), block=256,
                device_step=not host)
    for k, v in t.items():
        assert torch.equal(v, before[k]), k


def test_found_inf_zero_advances_step():
    step = torch.tensor(3.0)
    launch_adam(torch.randn(8), torch.randn(8), torch.zeros(8), torch.zeros(8), None,
                step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                decoupled=False, amsgrad=False, maximize=False,
                grad_scale=torch.tensor(1.0), found_inf=torch.tensor(0.0))
    assert step.item() == 4.0


def test_zero_beta_is_supported():
    _run_case(100, torch.float32, dict(beta1=0.0, beta2=0.0, weight_decay=1e-2))


def test_rejects_bad_arguments():
    w = torch.randn(16)
    kw = dict(step=torch.tensor(0.0), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.0, decoupled=False, amsgrad=False, maximize=False)
    with pytest.raises(ValueError, match="exp_avg must be contiguous"):
        launch_adam(torch.randn(4, 4), torch.randn(4, 4), torch.zeros(4, 4).t(),
                    torch.zeros(4, 4), None, **kw)
    with pytest.raises(ValueError, match="exp_avg_sq has shape"):
        launch_adam(w, torch.randn(16), torch.zeros(16), torch.zeros(17), None, **kw)
    with pytest.raises(TypeError, match="last_update must be torch.float32"):
        launch_adam(w, torch.randn(16), torch.zeros(16), torch.zeros(16), None,
                    last_update=torch.zeros(16).half(), **kw)
    with pytest.raises(ValueError, match="0 <= beta < 1"):
        launch_adam(w, torch.randn(16), torch.zeros(16), torch.zeros(16), None,
                    **{**kw, "beta2": 1.0})


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 5000),
    dtype=st.sampled_from(DTYPES),
    lr=st.floats(1e-5, 1e-1),
    beta1=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    beta2=st.sampled_from([0.9, 0.99, 0.999]),
    eps=st.sampled_from([1e-8, 1e-6]),
    weight_decay=st.sampled_from([0.0, 1e-2]),
    decoupled=st.booleans(),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    sc_delay=st.integers(0, 5),
    extras=st.booleans(),
    scale=st.booleans(),
    host=st.booleans(),
    start_step=st.sampled_from([0, 5, 1000]),
)
def test_fused_adam_property(n, dtype, lr, beta1, beta2, eps, weight_decay, decoupled,
                             amsgrad, maximize, sc_delay, extras, scale, host, start_step):
    case = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                decoupled=decoupled, amsgrad=amsgrad, maximize=maximize, sc_delay=sc_delay,
                pred=extras, last=extras, delta=extras, scale=scale, host=host)
    _run_case(n, dtype, case, block=1024, steps=2, start_step=start_step)
