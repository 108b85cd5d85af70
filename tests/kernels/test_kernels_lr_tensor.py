"""Learning rates as device tensors (issue 23): every launcher takes ``lr`` as a one-element
float32 tensor on the launch's device and loads it in the kernel, with the scalars derived
from it (SGD's prediction coefficient, AdamW/NAdamW's decoupled decay) computed from it on
the device with the host's arithmetic. The contract is bitwise: a launch with ``lr=t`` writes
exactly what the launch with ``lr=float(t)`` writes, over every dtype, odd sizes, single
tensors and segment tables, and the mitigations that take lr."""

from __future__ import annotations

import pytest
import torch
from kernel_support import DEVICE, _on_device  # noqa: F401 (autouse fixture)
from kernel_support import randn as _randn

from engine.optim.functional import prediction_coeff
from engine.triton_kernels import SegmentTable, launch_adam, launch_nadam, launch_sgd
from engine.triton_kernels.adam import ADAM_ROLES
from engine.triton_kernels.nadam import NADAM_ROLES
from engine.triton_kernels.sgd import SGD_ROLES
from engine.update_rules import lr_product

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 127, 1025]
# lr values that are not float32 numbers on the host are rounded when they become a tensor;
# the float path is run with the tensor's value, so that both launches see one lr
LRS = [0.037, 1e-3]

SGD_CASES = {
    "plain": dict(momentum=0.0),
    "momentum_wd": dict(weight_decay=1e-2),
    "nesterov": dict(nesterov=True),
    "sc3_pred_linear": dict(sc_delay=3, pred="linear"),
    "pred_momentum_delta_dc": dict(pred="momentum", delta=True, dc_coeff=2.0, dampening=0.1),
    "amp": dict(scale=True, pred="linear", delta=True),
}
ADAM_CASES = {
    "adam": dict(),
    "adamw": dict(weight_decay=0.1, decoupled=True),
    "adam_l2_amsgrad": dict(weight_decay=0.1, amsgrad=True),
    "adamw_sc_pred_delta_dc": dict(weight_decay=1e-2, decoupled=True, sc_delay=2, pred=True,
                                   delta=True, dc_coeff=20.0),
    "adamw_amp": dict(weight_decay=1e-2, decoupled=True, scale=True, last=True),
}
NADAM_CASES = {
    "nadam": dict(),
    "nadamw_pred_delta": dict(weight_decay=0.1, decoupled=True, pred=True, delta=True),
    "nadam_l2_dc": dict(weight_decay=0.1, delta=True, dc_coeff=20.0),
}


def _operands(n: int, dtype: torch.dtype, roles: dict[str, str], seed: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for role, kind in roles.items():
        if kind == "scalar":
            out[role] = torch.full((), 3.0 if role == "step" else 0.7, device=DEVICE)
        else:
            t = _randn(n, gen).to(dtype if kind == "param" else torch.float32)
            out[role] = t.abs() if role in ("v", "vmax") else t * (1e-2 if role == "delta" else 1)
    return out


def _check_twice(run, roles, dtype, lr_value, table_roles=None, scalar_roles=()):
    """``run(ops, lr)`` on two copies, once with the float lr and once with the tensor lr;
    single tensors (three sizes) or, with ``table_roles``, one segment table over them."""
    lr_t = torch.tensor(lr_value, dtype=torch.float32, device=DEVICE)
    lr_f = float(lr_t)
    segs = [_operands(n, dtype, roles, seed=n) for n in SIZES]
    copies = [{k: v.clone() for k, v in s.items()} for s in segs]
    for ops, lr in ((segs, lr_f), (copies, lr_t)):
        for _ in range(2):  # two steps: the second reads the state the first wrote
            if table_roles is None:
                for s in ops:
                    run(s, lr)
            else:
                rows = {r: [s[r] for s in ops] for r in roles}
                run(SegmentTable(table_roles, rows, scalar_roles=scalar_roles), lr, rows)
    for a, b in zip(segs, copies, strict=True):
        for role in roles:
            assert torch.equal(a[role], b[role]), role


def _sgd_run(case: dict):
    o = dict(case)
    pred, delta, scale = o.pop("pred", None), o.pop("delta", False), o.pop("scale", False)
    kw = dict(dict(momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                   maximize=False, init_momentum=False, delta_gamma=0.5), **o)
    roles = {"param": "param", "grad": "param"}
    if kw["momentum"]:
        roles["buf"] = "state"
    if pred:
        roles["pred"] = "param"
    if delta:
        roles["delta"] = "state"
    gs = torch.tensor(4.0, device=DEVICE) if scale else None
    fi = torch.zeros(1, device=DEVICE) if scale else None

    def coeff(lr):
        if pred is None:
            return 0.0
        per_lr = prediction_coeff(pred, 1.0, kw["momentum"], 3)
        # the optimizer's rule: the float path's coefficient from the float lr
        return lr_product(lr, per_lr) if isinstance(lr, torch.Tensor) else \
            prediction_coeff(pred, lr, kw["momentum"], 3)

    def run(s, lr, rows=None):  # s: one tensor's operands, or a table (then rows: its rows)
        src = rows if rows is not None else s
        launch_sgd(s if rows is not None else s["param"], src["grad"], src.get("buf"),
                   lr=lr, predicted=src.get("pred"), predict_coeff=coeff(lr),
                   delta=src.get("delta"), grad_scale=gs, found_inf=fi, **kw)

    return run, roles


@pytest.mark.parametrize("table", [False, True], ids=["tensor", "table"])
@pytest.mark.parametrize("lr", LRS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_tensor_lr_is_bitwise_the_float_lr(case, dtype, lr, table):
    run, roles = _sgd_run(SGD_CASES[case])
    _check_twice(run, roles, dtype, lr, SGD_ROLES if table else None)


def _adaptive_roles(o: dict, nadam: bool) -> dict[str, str]:
    roles = {"param": "param", "grad": "param", "m": "state", "v": "state"}
    if o.get("amsgrad"):
        roles["vmax"] = "state"
    for flag, role, kind in (("last", "last", "state"), ("pred", "pred", "param"),
                             ("delta", "delta", "state")):
        if o.get(flag):
            roles[role] = kind
    roles["step"] = "scalar"
    if nadam:
        roles["prod"] = "scalar"
    return roles


@pytest.mark.parametrize("table", [False, True], ids=["tensor", "table"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_tensor_lr_is_bitwise_the_float_lr(case, dtype, table):
    o = dict(ADAM_CASES[case])
    roles = _adaptive_roles(o, nadam=False)
    scale = o.pop("scale", False)
    for flag in ("last", "pred", "delta"):
        o.pop(flag, None)
    kw = dict(dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False,
                   amsgrad=False, maximize=False, predict_horizon=2.0, delta_gamma=0.5), **o)
    gs = torch.tensor(4.0, device=DEVICE) if scale else None
    fi = torch.zeros(1, device=DEVICE) if scale else None

    def run(s, lr, rows=None):
        src = rows if rows is not None else s
        launch_adam(s if rows is not None else s["param"], src["grad"], src["m"], src["v"],
                    src.get("vmax"), step=src["step"], lr=lr, last_update=src.get("last"),
                    predicted=src.get("pred"), delta=src.get("delta"), grad_scale=gs,
                    found_inf=fi, **kw)

    _check_twice(run, roles, dtype, 0.037, ADAM_ROLES if table else None, ("step",))


@pytest.mark.parametrize("table", [False, True], ids=["tensor", "table"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(NADAM_CASES))
def test_nadam_tensor_lr_is_bitwise_the_float_lr(case, dtype, table):
    o = dict(NADAM_CASES[case])
    roles = _adaptive_roles(o, nadam=True)
    for flag in ("last", "pred", "delta"):
        o.pop(flag, None)
    kw = dict(dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False,
                   momentum_decay=4e-3, maximize=False, predict_horizon=2.0, delta_gamma=0.5),
              **o)

    def run(s, lr, rows=None):
        src = rows if rows is not None else s
        launch_nadam(s if rows is not None else s["param"], src["grad"], src["m"], src["v"],
                     src["prod"], step=src["step"], lr=lr, last_update=src.get("last"),
                     predicted=src.get("pred"), delta=src.get("delta"), **kw)

    _check_twice(run, roles, dtype, 0.037, NADAM_ROLES if table else None, ("step", "prod"))


def test_a_new_tensor_value_is_read_by_the_same_launch_arguments():
    """What a CUDA graph relies on: the launch with the same lr tensor, its value written in
    place (as torch's schedulers write a Tensor lr), applies the new value."""
    w, g = torch.ones(8, device=DEVICE), torch.ones(8, device=DEVICE)
    lr = torch.tensor(0.5, device=DEVICE)
    kw = dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
              init_momentum=False)
    launch_sgd(w, g, None, lr=lr, **kw)
    lr.fill_(0.25)
    launch_sgd(w, g, None, lr=lr, **kw)
    assert torch.equal(w, torch.full((8,), 0.25, device=DEVICE))


def test_bad_lr_tensors_are_refused_before_anything_changes():
    w, g, buf = torch.ones(8, device=DEVICE), torch.ones(8, device=DEVICE), torch.zeros(8, device=DEVICE)
    kw = dict(momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
              init_momentum=True)
    with pytest.raises(ValueError, match="lr is a Tensor .* one float32 element"):
        launch_sgd(w, g, buf, lr=torch.tensor(0.1, dtype=torch.float64, device=DEVICE), **kw)
    with pytest.raises(ValueError, match="lr is a Tensor .* one float32 element"):
        launch_sgd(w, g, buf, lr=torch.tensor([0.1, 0.2], device=DEVICE), **kw)
    with pytest.raises(ValueError, match="predict_coeff must be a Tensor too"):
        launch_sgd(w, g, buf, lr=torch.tensor(0.1, device=DEVICE), predicted=torch.zeros_like(w),
                   predict_coeff=0.3, **kw)
    with pytest.raises(ValueError, match="predict_coeff is a Tensor but lr is a number"):
        launch_sgd(w, g, buf, lr=0.1, predicted=torch.zeros_like(w),
                   predict_coeff=torch.tensor(0.3, device=DEVICE), **kw)
    with pytest.raises(ValueError, match="lr is a Tensor"):
        launch_adam(w, g, torch.zeros_like(w), torch.zeros_like(w), None,
                    step=torch.zeros((), device=DEVICE), lr=torch.tensor(1, device=DEVICE),
                    beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False,
                    amsgrad=False, maximize=False)
    assert torch.equal(w, torch.ones(8, device=DEVICE)) and torch.equal(buf, torch.zeros(8, device=DEVICE))
