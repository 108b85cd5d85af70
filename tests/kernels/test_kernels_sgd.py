"""Fused SGD kernel (triton_kernels.sgd) against the reference math, under the interpreter on CPU.

Each case runs three steps (the first initializes the momentum buffer) from identical inputs
for kernel and reference; after comparing, the kernel's tensors are reset to the reference's
so that rounding differences cannot compound and the fp32 state can be held to a tight
tolerance. Tensors derived from the stored weights (param, predicted, delta) get the param
dtype's tolerance: one rounding to bf16/fp16 can land one ulp apart when the fp32 values
differ in their last bit (torch fuses some multiply-adds on CPU, the interpreter does not).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_support import DEVICE, _on_device, assert_kernel_close  # noqa: F401 (autouse fixture)
from kernel_support import randn as _randn

from engine.optim.functional import prediction_coeff, sgd_update
from engine.triton_kernels import launch_sgd

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 127, 1023]
# 65537 (more than one interpreter block, ragged tail) for the combinations that switch on
# the most features; the full grid at that size would take minutes under the interpreter
BIG = 65537
BIG_CASES = ["plain", "nesterov", "sc3", "amp", "dc"]

BASE = dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
            maximize=False)
CASES = {
    "plain": dict(momentum=0.0),
    "plain_wd_max": dict(momentum=0.0, weight_decay=1e-2, maximize=True),
    "momentum": dict(),
    "wd": dict(weight_decay=1e-2),
    "nesterov": dict(nesterov=True, weight_decay=5e-3),
    "dampening": dict(dampening=0.3),
    "maximize": dict(maximize=True, weight_decay=1e-2),
    "sc3": dict(sc_delay=3, weight_decay=1e-2),
    "sc1": dict(sc_delay=1),
    "linear_pred": dict(pred="linear"),
    "momentum_pred": dict(pred="momentum", sc_delay=2),
    "delta": dict(delta=True, dampening=0.1),
    "amp": dict(scale=True, weight_decay=1e-2, pred="linear", delta=True),
    # delay compensation: |dc_coeff * g * delta| ~ 5% of g, far above the tolerance
    "dc": dict(delta=True, dc_coeff=5.0, weight_decay=1e-2, maximize=True),
    "dc_amp_sc": dict(delta=True, dc_coeff=5.0, scale=True, sc_delay=2, momentum=0.0),
}


def _make(n, dtype, case, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    t = {
        "param": _randn(n, gen).to(dtype),
        "buf": torch.zeros(n),
        "predicted": torch.full((n,), 123.0, dtype=dtype) if "pred" in case else None,
        "delta": _randn(n, gen) * 1e-2 if case.get("delta") else None,
    }
    return t


def _kwargs(case, step, t, scale):
    kw = {k: v for k, v in {**BASE, **case}.items() if k not in ("pred", "delta", "scale")}
    if "pred" in case:
        kw["predict_coeff"] = prediction_coeff(case["pred"], kw["lr"], kw["momentum"], 3)
    kw["delta_gamma"] = 0.1 ** (1 / 3)
    kw["init_momentum"] = step == 0
    if case.get("scale"):
        kw["grad_scale"] = scale
        kw["found_inf"] = torch.tensor(0.0)
    return kw


def _run_case(n, dtype, case, block=None, steps=3, grad_dtype=None):
    ref = _make(n, dtype, case, seed=n)
    fused = {k: (v.clone() if v is not None else None) for k, v in ref.items()}
    gen = torch.Generator(device="cpu").manual_seed(n + 1)
    scale = torch.tensor(1024.0)
    for step in range(steps):
        g = _randn(n, gen).to(grad_dtype or dtype)
        if case.get("scale"):
            g = (g.float() * scale).to(grad_dtype or dtype)
        kw = _kwargs(case, step, ref, scale)
        before = ref["param"].clone()  # w_new = w - lr*u may cancel: compare at w's scale
        # v = m*v + (1-d)*g' cancels too (hypothesis: lr 0.625, wd 0.1, maximize, dampening
        # 0.1 left a buf 1e-4 of its terms): compare it at the scale of the old buffer
        buf_before = ref["buf"].clone()
        sgd_update(ref["param"], g, ref["buf"], predicted=ref["predicted"], delta=ref["delta"],
                   **kw)
        launch_sgd(fused["param"], g, fused["buf"], predicted=fused["predicted"],
                   delta=fused["delta"], block=block, **kw)
        for name, r in ref.items():
            if r is None:
                continue
            w = {"predicted": ref["param"], "delta": ref["param"], "param": before,
                 "buf": buf_before}.get(name)
            assert_kernel_close(name, fused[name], r, torch.float32 if name == "buf" else dtype, w)
            fused[name].copy_(r)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_fused_sgd_matches_reference(case, dtype, n):
    _run_case(n, dtype, CASES[case])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", BIG_CASES, ids=str)
def test_fused_sgd_matches_reference_big(case, dtype):
    _run_case(BIG, dtype, CASES[case])


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["momentum", "amp"])
def test_fp32_params_with_low_precision_grads(case, grad_dtype):
    # fp32 master weights fed half-precision gradients (AMP without a grad copy)
    _run_case(1023, torch.float32, CASES[case], grad_dtype=grad_dtype)


@pytest.mark.parametrize("case", ["momentum", "sc3", "amp"])
def test_fused_sgd_many_programs(case):
    # small blocks: many program instances and a ragged last block
    _run_case(1023, torch.float32, CASES[case], block=128)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_found_inf_writes_nothing(dtype):
    n = 1000
    param = torch.randn(n).to(dtype)
    buf, delta = torch.randn(n), torch.randn(n)
    pred = torch.randn(n).to(dtype)
    before = [t.clone() for t in (param, buf, delta, pred)]
    launch_sgd(param, torch.randn(n).to(dtype), buf, lr=0.1, momentum=0.9, dampening=0.0,
               weight_decay=1e-2, nesterov=False, maximize=False, init_momentum=False,
               sc_delay=2, predicted=pred, predict_coeff=0.3, delta=delta, delta_gamma=0.5,
               grad_scale=torch.tensor(2.0), found_inf=torch.tensor(1.0), block=256)
    for a, b in zip((param, buf, delta, pred), before, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sc1_equals_nesterov_in_kernel(dtype):
    """The contract (docs/ALGORITHMS.md, "Update rules"): SC with delay 1 is Nesterov bit for
    bit, in the kernel too, on every device: both run one explicit fma(m, v, g * b) with
    b = 1 (so g * b is exact). On the H100 the compiler's own contraction of the SC line
    made them differ in the last bit (issue 22)."""
    n = 4097
    gen = torch.Generator(device="cpu").manual_seed(3)
    g, buf0 = _randn(n, gen), _randn(n, gen)
    w0 = (1 + _randn(n, gen)).to(dtype)
    outs = []
    for kw in (dict(nesterov=True), dict(sc_delay=1)):
        w, buf = w0.clone(), buf0.clone()
        launch_sgd(w, g, buf, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=1e-2,
                   maximize=False, init_momentum=False, **{"nesterov": False, **kw})
        outs.append((w, buf))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_sgd_kernel_writes_its_multiply_adds_as_explicit_fma():
    """Static half of the contract above: the SC and Nesterov lines are explicit tl.fma
    calls, so a GPU compiler cannot contract them differently."""
    import inspect

    from engine.triton_kernels import sgd as ksgd

    src = inspect.getsource(ksgd._sgd_body.fn)
    assert "upd = tl.fma(sc_a, v, g * sc_b)" in src
    assert "upd = tl.fma(momentum, v, g)" in src


def test_bf16_rounding_is_nearest_even():
    # fp32 values exactly halfway between bf16 neighbours and just beside them
    base = torch.tensor([1.0, 1.0078125, -3.0, 256.0])
    half_ulp = torch.tensor([2.0**-8, 2.0**-8 * 1.0078125, 2.0**-7 * 3 / 2, 1.0])
    upd = torch.cat([half_ulp, half_ulp * 1.001, half_ulp * 0.999])
    w0 = torch.cat([base, base, base])
    w = w0.to(torch.bfloat16)
    # plain SGD with lr = -1: w + upd in fp32, then one rounding
    launch_sgd(w, upd, None, lr=-1.0, momentum=0.0, dampening=0.0, weight_decay=0.0,
               nesterov=False, maximize=False, init_momentum=True)
    assert torch.equal(w, (w0 + upd).to(torch.bfloat16))


def test_bf16_rounding_keeps_specials():
    big = torch.finfo(torch.bfloat16).max
    w0 = torch.tensor([float("inf"), float("-inf"), float("nan"), big, -big, 0.0])
    # 0.75 ulp past bf16's largest finite value: finite in fp32, rounds to inf in bf16
    upd = torch.tensor([0.0, 0.0, 0.0, 0.75 * 2.0**120, -0.75 * 2.0**120, -0.0])
    w = w0.to(torch.bfloat16)
    launch_sgd(w, upd, None, lr=-1.0, momentum=0.0, dampening=0.0, weight_decay=0.0,
               nesterov=False, maximize=False, init_momentum=True)
    expected = (w0 + upd).to(torch.bfloat16)
    assert torch.equal(w.isnan(), expected.isnan())
    assert torch.equal(w[~w.isnan()], expected[~expected.isnan()])
    assert w[3].item() == float("inf") and w[4].item() == float("-inf")


def test_rejects_bad_arguments():
    w = torch.randn(16)
    kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
              maximize=False, init_momentum=False)
    with pytest.raises(ValueError, match="param must be contiguous"):
        launch_sgd(torch.randn(4, 4).t(), torch.randn(4, 4), torch.zeros(4, 4), **kw)
    with pytest.raises(ValueError, match="momentum_buffer must be contiguous"):
        launch_sgd(torch.randn(4, 4), torch.randn(4, 4), torch.zeros(4, 4).t(), **kw)
    with pytest.raises(ValueError, match="delta has shape"):
        launch_sgd(w, torch.randn(16), torch.zeros(16), delta=torch.zeros(15), **kw)
    with pytest.raises(TypeError, match="momentum_buffer must be torch.float32"):
        launch_sgd(w, torch.randn(16), torch.zeros(16, dtype=torch.bfloat16), **kw)
    with pytest.raises(TypeError, match="grad must be a Tensor"):
        launch_sgd(w, None, torch.zeros(16), **kw)
    with pytest.raises(ValueError, match="block is fixed when a SegmentTable is built"):
        from engine.triton_kernels import SegmentTable

        table = SegmentTable(("param", "grad", "buf", "pred", "delta"),
                             {"param": [w], "grad": [torch.randn(16)], "buf": [torch.zeros(16)]})
        launch_sgd(table, None, None, block=256, **kw)
    with pytest.raises(ValueError, match="found_inf must be a one-element"):
        launch_sgd(w, torch.randn(16), torch.zeros(16), found_inf=torch.zeros(2), **kw)


def test_empty_tensor_is_a_no_op():
    w = torch.empty(0)
    launch_sgd(w, torch.empty(0), torch.empty(0), **BASE, init_momentum=True)
    assert w.numel() == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 5000),
    dtype=st.sampled_from(DTYPES),
    lr=st.floats(1e-4, 1.0),
    momentum=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    dampening=st.sampled_from([0.0, 0.1]),
    weight_decay=st.sampled_from([0.0, 1e-4, 0.1]),
    nesterov=st.booleans(),
    maximize=st.booleans(),
    sc_delay=st.integers(0, 6),
    pred=st.sampled_from([None, "linear", "momentum"]),
    delta=st.booleans(),
    scale=st.booleans(),
)
def test_fused_sgd_property(n, dtype, lr, momentum, dampening, weight_decay, nesterov,
                            maximize, sc_delay, pred, delta, scale):
    case = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                nesterov=nesterov and dampening == 0.0, maximize=maximize, sc_delay=sc_delay,
                delta=delta, scale=scale)
    if pred is not None:
        case["pred"] = pred
    _run_case(n, dtype, case, block=1024, steps=2)


@pytest.mark.parametrize("old", ["fused_sgd_update", "fused_sgd_multi"])
def test_deprecated_entry_points_warn_and_launch(old):
    """The entry points before launch_sgd took tables keep working until 0.4, with a
    DeprecationWarning; the same bits as the launcher."""
    import engine.triton_kernels as tk

    w0, g = torch.randn(37), torch.randn(37)
    kw = dict(BASE, init_momentum=True)
    want, buf = w0.clone(), torch.zeros(37)
    launch_sgd(want, g, buf, **kw)
    w, buf2 = w0.clone(), torch.zeros(37)
    target = w if old == "fused_sgd_update" else tk.SegmentTable(
        ("param", "grad", "buf", "pred", "delta"), {"param": [w], "grad": [g], "buf": [buf2]})
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated.*launch_sgd"):
        getattr(tk, old)(target, g, buf2, **kw)
    assert torch.equal(w, want) and torch.equal(buf2, buf)
