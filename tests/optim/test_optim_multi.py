"""Multi-tensor launches (triton_kernels/multi.py, engine/optim/multi.py): one kernel launch
over many tensors of a group, bit for bit the single-tensor kernel's result.

Kernel level: every ``fused_*_multi`` against its ``fused_*_update`` called tensor by tensor,
over odd sizes (1, 127, 65537 and mixed), every param dtype, unaligned views and the option
flags that change the code. Optimizer level: the per-tensor fused path (now one launch per
group and dtype signature) against the same optimizer with multi-tensor launches switched
off, several groups and mixed dtypes; launch counts; the layout cache (gradient row refreshed
when autograd hands new gradients, nothing rebuilt otherwise); several flat buckets of one
group in one launch.
"""

from __future__ import annotations

import pytest
import torch
from kernel_support import DEVICE, _on_device  # noqa: F401 (autouse fixture)
from torch import nn

import engine.optim as eo
from engine.triton_kernels import SegmentTable, launch_adam, launch_nadam, launch_sgd
from engine.triton_kernels import adaptive as kadaptive
from engine.triton_kernels import sgd as ksgd
from engine.triton_kernels.adam import ADAM_ROLES
from engine.triton_kernels.nadam import NADAM_ROLES
from engine.triton_kernels.sgd import SGD_ROLES

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 127, 65537, 16, 300]


def _tensors(n: int, dtype: torch.dtype, gen: torch.Generator, roles: dict[str, str],
             offset: int) -> dict[str, torch.Tensor]:
    """One segment's operands; ``offset`` > 0 makes every one an unaligned view."""
    out = {}
    for role, kind in roles.items():
        if kind == "scalar":
            out[role] = torch.full((), 3.0 if role == "step" else 0.7, device=DEVICE)
            continue
        dt = dtype if kind == "param" else torch.float32
        base = torch.rand if role in ("v", "vmax") else torch.randn
        t = (base(n + offset, generator=gen, device="cpu") * (1e-3 if role == "delta" else 1)).to(DEVICE, dt)
        out[role] = t[offset:]
    return out


def _compare(single, multi, roles, table_roles, scalar_roles, dtype, kwargs, offset=0,
             found_inf=None, sizes=SIZES):
    gen = torch.Generator().manual_seed(0)
    segs = [_tensors(n, dtype, gen, roles, offset if i % 2 else 0) for i, n in enumerate(sizes)]
    copies = [{k: t.clone() for k, t in s.items()} for s in segs]
    for s in segs:
        single(s, found_inf)
    rows = {r: [c[r] for c in copies] for r in roles}
    table = SegmentTable(table_roles, rows, scalar_roles=scalar_roles)
    # odd sizes or views: the scalar path; sizes of 16s at fresh allocations: the hinted one
    assert table.nseg == len(sizes) and table.aligned is (offset == 0 and sizes is not SIZES)
    multi(table, rows, found_inf)
    for s, c in zip(segs, copies, strict=True):
        for role in roles:
            assert torch.equal(s[role], c[role]), (role, kwargs)


SGD_CASES = {
    "plain": dict(momentum=0.0),
    "momentum_init": dict(init_momentum=True, weight_decay=1e-2),
    "nesterov_maximize": dict(nesterov=True, maximize=True),
    "sc_pred_delta_dc_amp": dict(sc_delay=3, dampening=0.1, pred=True, delta=True, dc_coeff=0.5,
                                 scale=True),
    "amp_overflow": dict(scale=True, inf=True, delta=True),  # nothing may change
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_multi_equals_single(case: str, dtype: torch.dtype) -> None:
    o = dict(SGD_CASES[case])
    pred, delta, scale = o.pop("pred", False), o.pop("delta", False), o.pop("scale", False)
    found_inf = torch.ones(1, device=DEVICE) if o.pop("inf", False) else None
    kw = dict(dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                   maximize=False, init_momentum=False, predict_coeff=0.3, delta_gamma=0.5), **o)
    roles = {"param": "param", "grad": "param"}
    if kw["momentum"]:
        roles["buf"] = "state"
    if pred:
        roles["pred"] = "param"
    if delta:
        roles["delta"] = "state"
    gs = torch.tensor([4.0], device=DEVICE) if scale else None

    def single(s, found_inf):
        launch_sgd(s["param"], s["grad"], s.get("buf"), predicted=s.get("pred"),
                   delta=s.get("delta"), grad_scale=gs, found_inf=found_inf, **kw)

    def multi(table, rows, found_inf):
        launch_sgd(table, rows["grad"], rows.get("buf"), predicted=rows.get("pred"),
                   delta=rows.get("delta"), grad_scale=gs, found_inf=found_inf, **kw)

    _compare(single, multi, roles, SGD_ROLES, (), dtype, kw,
             offset=1 if case == "plain" else 3, found_inf=found_inf)


ADAM_CASES = {
    "adam": dict(),
    "adamw_amsgrad_maximize": dict(weight_decay=0.1, decoupled=True, amsgrad=True,
                                   maximize=True),
    "sc_pred_delta_dc_amp": dict(sc_delay=2, last=True, pred=True, delta=True, dc_coeff=50.0,
                                 weight_decay=1e-2, scale=True),
    "amp_overflow": dict(scale=True, inf=True, amsgrad=True),  # nothing, step included, changes
}


def _adam_roles(o: dict, nadam: bool) -> dict[str, str]:
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_multi_equals_single(case: str, dtype: torch.dtype) -> None:
    o = dict(ADAM_CASES[case])
    roles = _adam_roles(o, nadam=False)
    scale = o.pop("scale", False)
    found_inf = torch.ones(1, device=DEVICE) if o.pop("inf", False) else None
    for flag in ("last", "pred", "delta"):  # in roles
        o.pop(flag, None)
    kw = dict(dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                   decoupled=False, amsgrad=False, maximize=False, predict_horizon=2.0,
                   delta_gamma=0.5), **o)
    gs = torch.tensor([4.0], device=DEVICE) if scale else None

    def single(s, found_inf):
        launch_adam(s["param"], s["grad"], s["m"], s["v"], s.get("vmax"), step=s["step"],
                    last_update=s.get("last"), predicted=s.get("pred"), delta=s.get("delta"),
                    grad_scale=gs, found_inf=found_inf, **kw)

    def multi(table, rows, found_inf):
        launch_adam(table, rows["grad"], rows["m"], rows["v"], rows.get("vmax"),
                    step=rows["step"], last_update=rows.get("last"), predicted=rows.get("pred"),
                    delta=rows.get("delta"), grad_scale=gs, found_inf=found_inf, **kw)

    _compare(single, multi, roles, ADAM_ROLES, ("step",), dtype, kw, offset=2,
             found_inf=found_inf)
    if case == "sc_pred_delta_dc_amp":  # ALIGNED=True (the GPU's vectorized variant)
        _compare(single, multi, roles, ADAM_ROLES, ("step",), dtype, kw,
                 sizes=[16, 4096, 65536 + 16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("found", [0.0, 1.0], ids=["finite", "overflow"])
def test_nadam_multi_equals_single(dtype: torch.dtype, found: float) -> None:
    o = dict(last=True, pred=True, delta=True)
    roles = _adam_roles(o, nadam=True)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, decoupled=True,
              momentum_decay=4e-3, maximize=True, predict_horizon=2.0, delta_gamma=0.5,
              dc_coeff=20.0)
    found_inf = torch.tensor([found], device=DEVICE)

    def single(s, fi):
        launch_nadam(s["param"], s["grad"], s["m"], s["v"], s["prod"], step=s["step"],
                     last_update=s["last"], predicted=s["pred"], delta=s["delta"],
                     found_inf=fi, **kw)

    def multi(table, rows, fi):
        launch_nadam(table, rows["grad"], rows["m"], rows["v"], rows["prod"], step=rows["step"],
                     last_update=rows["last"], predicted=rows["pred"], delta=rows["delta"],
                     found_inf=fi, **kw)

    _compare(single, multi, roles, NADAM_ROLES, ("step", "prod"), dtype, kw, offset=1,
             found_inf=found_inf)


def test_table_refuses_bad_segments_and_mismatched_arguments() -> None:
    p = [torch.randn(4, device=DEVICE), torch.randn(5, device=DEVICE)]
    g = [torch.randn(4, device=DEVICE), torch.randn(6, device=DEVICE)]
    with pytest.raises(ValueError, match="segment 1 grad has 6 elements, its param 5"):
        SegmentTable(SGD_ROLES, {"param": p, "grad": g})
    with pytest.raises(ValueError, match="segment 1 grad must be contiguous"):
        SegmentTable(SGD_ROLES, {"param": [p[0], torch.randn(2, 2, device=DEVICE)],
                                      "grad": [g[0], torch.randn(2, 2, device=DEVICE).t()]})
    table = SegmentTable(SGD_ROLES, {"param": p, "grad": [g[0], torch.randn(5, device=DEVICE)]})
    before = [t.clone() for t in p]
    kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
              maximize=False, init_momentum=True)
    with pytest.raises(ValueError, match="uses buf, the segment table has no buf row"):
        launch_sgd(table, None, None, **kw)
    table.release("grad")
    with pytest.raises(ValueError, match="released role"):
        launch_sgd(table, None, None, **dict(kw, momentum=0.0))
    assert all(torch.equal(a, b) for a, b in zip(p, before, strict=True))  # nothing written


# ----------------------------------------------------------------------------- optimizer


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    m[2].to(torch.bfloat16)  # a second dtype signature in the first group
    return m.to(DEVICE)


def _groups(m: nn.Module, **second) -> list[dict]:
    return [{"params": list(m[0].parameters()) + list(m[2].parameters())},
            {"params": list(m[4].parameters()), **second}]


def _train(m: nn.Module, opt, steps: int, set_to_none: bool = True) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        x = torch.randn(6, 7, generator=gen, device="cpu").to(DEVICE)
        h = m[1](m[0](x)).to(torch.bfloat16)
        m[4](m[3](m[2](h)).float()).sin().sum().backward()
        opt.step()


OPT_CASES = {
    "sgd": (eo.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, delay=2,
                         spike_compensation=True, prediction="linear",
                         discrepancy_correction=True, delay_compensation=1.0),
            dict(momentum=0.8, nesterov=True, dampening=0.0, spike_compensation=False,
                 maximize=True)),
    "adam": (eo.Adam, dict(lr=0.01, amsgrad=True, delay=2, prediction="momentum",
                           discrepancy_correction=True, spike_compensation=True),
             dict(weight_decay=0.1, decoupled_weight_decay=True, prediction=None)),
    "nadam": (eo.NAdam, dict(lr=0.01, delay=2, prediction="linear", discrepancy_correction=True,
                             weight_decay=0.01), dict(decoupled_weight_decay=True)),
}


@pytest.mark.parametrize("set_to_none", [True, False], ids=["fresh-grads", "kept-grads"])
@pytest.mark.parametrize("name", list(OPT_CASES))
def test_optimizer_multi_equals_single_tensor_launches(name: str, set_to_none: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cls, cfg, second = OPT_CASES[name]
    a, b = _model(), _model()
    opt_a = cls(_groups(a, **second), fused=True, **cfg)
    opt_b = cls(_groups(b, **second), fused=True, **cfg)
    launches = []
    # the module whose launcher reads the multi-tensor kernel (Adam and NAdam: one launcher module)
    where = {"sgd": ksgd, "adam": kadaptive, "nadam": kadaptive}[name]
    kernel = getattr(where, f"_{name}_multi_kernel")

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(opt_b, "_multi_tensors", lambda group, params, *rest: params)
    _train(b, opt_b, 3, set_to_none)
    with monkeypatch.context() as mp:
        mp.setattr(where, f"_{name}_multi_kernel", Spy())
        _train(a, opt_a, 3, set_to_none)
    # group 0: fp32 and bf16 params (two signatures), group 1: one; 3 steps
    assert len(launches) == 3 * 3
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    for pid, entry in sb.items():
        for key, value in entry.items():
            assert torch.equal(sa[pid][key], value), (pid, key)
    for u, v in zip(opt_a.predicted_weights(), opt_b.predicted_weights(), strict=True):
        assert torch.equal(u, v)


def test_layout_cache_refreshes_grads_and_rebuilds_only_on_layout_change() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(DEVICE)
    opt = eo.Adam(m.parameters(), lr=0.1, fused=True)
    x = torch.randn(3, 4).to(DEVICE)

    def step(set_to_none: bool):
        opt.zero_grad(set_to_none=set_to_none)
        m(x).sum().backward()
        opt.step()
        return opt._layouts.get(id(opt.param_groups[0]), (None, None))[1]

    assert step(True) is None  # the first step's layout is dropped (state was created)
    layout = step(True)
    table = layout.launches[0].table
    kept = [p.grad for p in m.parameters()]
    assert step(False) is layout and layout.launches[0].table is table  # reused
    assert table.ptrs["grad"] == [g.data_ptr() for g in kept]
    for p in m.parameters():  # new gradient tensors: the same layout, the grad row refreshed
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt._layouts[id(opt.param_groups[0])][1] is layout
    assert table.ptrs["grad"] == [p.grad.data_ptr() for p in m.parameters()] != [
        g.data_ptr() for g in kept]
    assert table._refs["grad"] is None  # the table keeps no gradient alive between steps
    # replaced state (load_state_dict) and a changed state layout (amsgrad) rebuild
    opt.load_state_dict(opt.state_dict())
    rebuilt = step(True)
    assert rebuilt is not None and rebuilt is not layout
    assert len(opt._layouts) == 1  # the replaced group's layout (and its state) is dropped
    opt.param_groups[0]["amsgrad"] = True
    assert step(True) not in (layout, rebuilt)


def test_several_flat_buckets_of_one_group_take_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine._C  # noqa: F401  (the extension: an import error fails, it does not skip)
    import engine.arena as arena_mod
    from engine.optim.flat import FlatBinding

    cfg = dict(lr=0.05, momentum=0.9, delay=2, prediction="linear", fused=True)
    flat, per = _model(), _model()
    for mod in (flat[0], flat[4]):  # two arenas, fp32: one group, two buckets
        arena_mod.flatten_(mod)
    opt_f = eo.SGD(list(flat[0].parameters()) + list(flat[4].parameters()), **cfg)
    opt_f.bind_flat([FlatBinding(view=arena_mod.flat_buffers_for(list(mod.parameters())),
                                 params=tuple(mod.parameters())) for mod in (flat[0], flat[4])])
    opt_p = eo.SGD(list(per[0].parameters()) + list(per[4].parameters()), **cfg)
    monkeypatch.setattr(opt_p, "_multi_tensors", lambda group, params, *rest: params)
    calls = []
    original = opt_f._call_update
    monkeypatch.setattr(opt_f, "_call_update", lambda fn, g, param, *r: (
        calls.append(type(param).__name__), original(fn, g, param, *r))[1])
    gen = torch.Generator().manual_seed(2)
    for m, opt in ((flat, opt_f), (per, opt_p)):
        gen.manual_seed(2)
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            x = torch.randn(5, 7, generator=gen, device="cpu").to(DEVICE)
            m[4](m[0](x)[:, :3]).sin().sum().backward()
            opt.step()
    assert calls == ["SegmentTable"] * 3  # both buckets in one launch per step
    for p, q in zip(flat.parameters(), per.parameters(), strict=True):
        assert torch.equal(p, q)
    for u, v in zip(opt_f.predicted_weights(), opt_p.predicted_weights(), strict=True):
        assert torch.equal(u, v)
