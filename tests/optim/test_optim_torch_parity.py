"""engine.optim side by side with torch.optim: every keyword, every dtype, state_dicts both
ways, sparse gradients, autograd through step().

With the delay options off, an engine optimizer must be a drop-in: the same keywords with
torch's meaning, bit-identical results on CPU (same op order), state_dicts that load in both
directions and keep stepping identically. The fused kernels are held to the reference in
test_optim_fused.py; here fused=True only shows the dtype fallback.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import engine.optim as eo

STEPS = 4

SGD_CONFIGS = [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1, "maximize": True},
    {"momentum": 1.0},  # accepted, as torch does
    {"momentum": 0.5, "dampening": 1.5},  # torch does not bound dampening
    {"lr": torch.tensor(0.05), "momentum": 0.9},
]
ADAM_CONFIGS = [
    {},
    {"amsgrad": True, "weight_decay": 0.1},
    {"betas": (0.8, 0.9), "eps": 1e-6, "maximize": True},
    {"lr": torch.tensor(0.01), "weight_decay": 0.05},
    {"betas": (torch.tensor(0.85), torch.tensor(0.95))},
]
FLAGS = [{}, {"foreach": True}, {"foreach": False}, {"fused": False}]
DTYPES = [torch.float32, torch.float64, torch.complex64, torch.complex128]


def _params(dtype: torch.dtype, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,), (1,), (2, 2, 3)]
    out = []
    for shape in shapes:
        real = torch.randn(*shape, 2 if dtype.is_complex else 1, generator=g, dtype=torch.float64)
        t = torch.view_as_complex(real) if dtype.is_complex else real[..., 0]
        out.append(nn.Parameter(t.to(dtype).contiguous()))
    return out


def _grads(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for p in params:
        real = torch.randn(*p.shape, 2 if p.is_complex() else 1, generator=g, dtype=torch.float64)
        t = torch.view_as_complex(real) if p.is_complex() else real[..., 0]
        out.append(t.to(p.dtype).contiguous())
    return out


def _run(opt: torch.optim.Optimizer, params: list[nn.Parameter], steps: int, start: int = 0) -> None:
    for k in range(start, start + steps):
        for p, g in zip(params, _grads(params, k), strict=True):
            p.grad = g
        opt.step()


def _pair(cls_name: str, dtype: torch.dtype, kw: dict) -> tuple[list, list, torch.optim.Optimizer, torch.optim.Optimizer]:
    a, b = _params(dtype), _params(dtype)
    ours = getattr(eo, cls_name)(a, **kw)
    theirs_kw = {k: v for k, v in kw.items() if k != "fused"}
    if dtype.is_complex and theirs_kw.get("foreach"):
        # torch's own foreach Adam rounds complex L2 decay differently from its single-tensor
        # path; ours never changes with foreach and equals the single-tensor one
        theirs_kw["foreach"] = False
    theirs = getattr(torch.optim, cls_name)(b, **theirs_kw)
    return a, b, ours, theirs


def _assert_equal(a: list, b: list, what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"{what}: tensor {i} differs (max |diff| {(x - y).abs().max().item():.3g})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "default")
@pytest.mark.parametrize("cfg", SGD_CONFIGS, ids=lambda c: ",".join(c) or "plain")
def test_sgd_equals_torch_bitwise(cfg: dict, flags: dict, dtype: torch.dtype) -> None:
    kw = {"lr": 0.05, **cfg, **flags}
    a, b, ours, theirs = _pair("SGD", dtype, kw)
    _run(ours, a, STEPS)
    _run(theirs, b, STEPS)
    _assert_equal(a, b, f"SGD {kw} {dtype}")
    for pa, pb in zip(a, b, strict=True):
        if pb in theirs.state:
            assert torch.equal(ours.state[pa]["momentum_buffer"], theirs.state[pb]["momentum_buffer"])
        else:
            assert pa not in ours.state  # torch keeps no entry without momentum: neither do we


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "default")
@pytest.mark.parametrize("cfg", ADAM_CONFIGS, ids=lambda c: ",".join(c) or "plain")
@pytest.mark.parametrize("cls_name", ["Adam", "AdamW"])
def test_adam_equals_torch_bitwise(cls_name: str, cfg: dict, flags: dict, dtype: torch.dtype) -> None:
    if "lr" in cfg and flags.get("foreach"):
        pytest.skip("torch refuses a Tensor lr with foreach=True and capturable=False (tested as an error)")
    if "betas" in cfg and isinstance(cfg["betas"][0], torch.Tensor) and flags.get("foreach"):
        pytest.skip("torch refuses Tensor betas with foreach=True and capturable=False")
    kw = {"lr": 0.01, **cfg, **flags}
    a, b, ours, theirs = _pair(cls_name, dtype, kw)
    _run(ours, a, STEPS)
    _run(theirs, b, STEPS)
    _assert_equal(a, b, f"{cls_name} {kw} {dtype}")
    for pa, pb in zip(a, b, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[pa][key], theirs.state[pb][key]), key


def test_adam_decoupled_weight_decay_is_adamw() -> None:
    a, b, c = _params(torch.float32), _params(torch.float32), _params(torch.float32)
    _run(eo.Adam(a, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True), a, STEPS)
    _run(torch.optim.AdamW(b, lr=0.01, weight_decay=0.1), b, STEPS)
    _run(eo.AdamW(c, lr=0.01, weight_decay=0.1), c, STEPS)
    _assert_equal(a, b, "Adam(decoupled_weight_decay=True) vs torch AdamW")
    _assert_equal(c, b, "engine AdamW vs torch AdamW")


@pytest.fixture
def cpu_capturable(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's capturable Adam refuses CPU tensors (a device check, not the math): let it run
    here so its tensor-bias-correction path is the reference for ours."""
    import torch.optim.adam as torch_adam

    monkeypatch.setattr(torch_adam, "_get_capturable_supported_devices", lambda *a, **k: ["cpu", "cuda"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64], ids=str)
@pytest.mark.parametrize("cfg", [{}, {"amsgrad": True, "weight_decay": 0.1}, {"maximize": True}],
                         ids=["plain", "amsgrad-wd", "maximize"])
@pytest.mark.parametrize("cls_name", ["Adam", "AdamW"])
def test_capturable_equals_torch_capturable(cls_name: str, cfg: dict, dtype, cpu_capturable) -> None:
    """capturable=True: bias corrections stay tensors (no host read of the step count), op for
    op as torch's capturable path; the step count stays beside the param."""
    kw = {"lr": 0.01, "capturable": True, **cfg}
    a, b, ours, theirs = _pair(cls_name, dtype, kw)
    _run(ours, a, STEPS)
    _run(theirs, b, STEPS)
    _assert_equal(a, b, f"{cls_name} capturable {cfg} {dtype}")
    step = ours.state[a[0]]["step"]
    assert isinstance(step, torch.Tensor) and step.device == a[0].device and float(step) == STEPS


# ----------------------------------------------------------------------------- autograd


def _diff_step(cls_name: str, kw: dict, state_keys: tuple[str, ...]):
    """torch's own differentiable-optimizer test pattern: step() on a non-leaf copy of the
    param, with the state handed in; returns the new param and state."""

    def fn(p: torch.Tensor, grad: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = p.clone()
        p.grad = grad
        opt = getattr(eo, cls_name)([p], differentiable=True, **kw)
        entry = {k: s.clone() for k, s in zip(state_keys, state, strict=True)}
        if cls_name != "SGD":
            entry["step"] = torch.tensor(3.0)
        opt.state[p].update(entry)
        opt.step()
        return (p, *(opt.state[p][k] for k in state_keys))

    return fn


@pytest.mark.parametrize("cls_name,kw,keys", [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, ("momentum_buffer",)),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True}, ("momentum_buffer",)),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "spike_compensation": True, "delay": 2}, ("momentum_buffer",)),
    ("Adam", {"lr": 0.1, "weight_decay": 0.1}, ("exp_avg", "exp_avg_sq")),
    ("AdamW", {"lr": 0.1, "amsgrad": True}, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
])
def test_gradcheck_through_step(cls_name: str, kw: dict, keys: tuple[str, ...]) -> None:
    g = torch.Generator().manual_seed(3)
    p = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True)
    grad = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True)
    state = [torch.rand(6, dtype=torch.float64, generator=g, requires_grad=True) + 0.1 for _ in keys]
    assert torch.autograd.gradcheck(_diff_step(cls_name, kw, keys), (p, grad, *state))


@pytest.mark.parametrize("cls_name,kw", [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
    ("Adam", {"lr": 0.1, "weight_decay": 0.1}),  # amsgrad over several steps fails in torch too
    ("AdamW", {"lr": 0.1, "maximize": True}),
])
def test_differentiable_values_equal_torch(cls_name: str, kw: dict) -> None:
    """differentiable=True changes how, not what: the values equal torch's differentiable run."""
    outs = []
    for mod in (eo, torch.optim):
        x = torch.linspace(-1, 1, 6, dtype=torch.float64, requires_grad=True)
        p = x * 1.5  # a non-leaf param, as differentiable optimization uses it
        opt = getattr(mod, cls_name)([p], differentiable=True, **kw)
        for k in range(3):
            p.grad = torch.full_like(p, 0.1 * (k + 1)).detach()
            opt.step()
        outs.append(p)
        p.sum().backward()
        outs.append(x.grad)
    _assert_equal(outs[:2], outs[2:], f"{cls_name} differentiable (weights, grad w.r.t. the start)")


# ----------------------------------------------------------------------------- state_dict


@pytest.mark.parametrize("cls_name,kw", [
    ("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.05}),
    ("Adam", {"lr": 0.01, "amsgrad": True}),
    ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
])
@pytest.mark.parametrize("direction", ["engine->torch", "torch->engine"])
def test_state_dict_crosses_over_and_keeps_stepping(cls_name: str, kw: dict, direction: str) -> None:
    src_mod, dst_mod = (eo, torch.optim) if direction == "engine->torch" else (torch.optim, eo)
    a = _params(torch.float32)
    src = getattr(src_mod, cls_name)(a, **kw)
    _run(src, a, 3)
    b = [nn.Parameter(p.detach().clone()) for p in a]
    dst = getattr(dst_mod, cls_name)(b, **kw)
    dst.load_state_dict(copy.deepcopy(src.state_dict()))  # as through torch.save/torch.load
    _run(src, a, 3, start=3)
    _run(dst, b, 3, start=3)
    _assert_equal(a, b, f"{cls_name} {direction}")


@pytest.mark.parametrize("cls_name,kw", [
    ("SGD", {"lr": 0.05}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "spike_compensation": True, "delay": 2}),
    ("Adam", {"lr": 0.01, "prediction": "linear", "delay": 1}),
    ("AdamW", {"lr": 0.01, "capturable": True, "foreach": False}),
])
def test_state_dict_round_trip_adds_no_keys(cls_name: str, kw: dict) -> None:
    a = _params(torch.float32)
    opt = getattr(eo, cls_name)(a, **kw)
    _run(opt, a, 2)
    sd = opt.state_dict()
    fresh = getattr(eo, cls_name)([nn.Parameter(p.detach().clone()) for p in a], **kw)
    fresh.load_state_dict(sd)
    again = fresh.state_dict()
    assert [sorted(g) for g in again["param_groups"]] == [sorted(g) for g in sd["param_groups"]]
    assert again["state"].keys() == sd["state"].keys()
    for pid, entry in sd["state"].items():
        assert again["state"][pid].keys() == entry.keys()
    if cls_name == "SGD" and "momentum" not in kw:
        assert sd["state"] == {}  # no empty per-parameter entries


def test_adam_python_number_step_loads_and_steps() -> None:
    """Older checkpoints keep Adam's step as a Python number."""
    a, b = _params(torch.float32), _params(torch.float32)
    ref = torch.optim.Adam(b, lr=0.01)
    _run(ref, b, 2)
    sd = copy.deepcopy(ref.state_dict())
    for entry in sd["state"].values():
        entry["step"] = float(entry["step"])
    ours = eo.Adam(a, lr=0.01)
    with torch.no_grad():
        for pa, pb in zip(a, b, strict=True):
            pa.copy_(pb)
    ours.load_state_dict(sd)
    _run(ours, a, 2, start=2)
    _run(ref, b, 2, start=2)
    _assert_equal(a, b, "Adam after loading a Python-number step")


def test_adamw_loading_an_adam_state_dict_stays_adamw() -> None:
    """As torch.optim.AdamW: the loaded groups say decoupled_weight_decay=False, AdamW keeps
    its decoupled decay."""
    a = _params(torch.float32)
    adam = eo.Adam(a, lr=0.01, weight_decay=0.1)
    _run(adam, a, 1)
    results = []
    for mod in (eo, torch.optim):
        ps = [nn.Parameter(p.detach().clone()) for p in a]
        w = mod.AdamW(ps, lr=0.01, weight_decay=0.1)
        w.load_state_dict(adam.state_dict())
        assert w.param_groups[0]["decoupled_weight_decay"] is True
        _run(w, ps, 2, start=1)
        results.append(ps)
    _assert_equal(results[0], results[1], "AdamW after loading an Adam state_dict")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_state_is_fp32_and_converts_at_the_torch_boundary(dtype) -> None:
    """A documented improvement: bf16/fp16 params keep fp32 state here; torch's state_dict
    (state in the param dtype) loads as fp32, and ours loads into torch (which casts)."""
    a = _params(dtype)
    ours = eo.Adam(a, lr=0.01)
    _run(ours, a, 2)
    assert all(ours.state[p]["exp_avg"].dtype == torch.float32 for p in a)
    b = [nn.Parameter(p.detach().clone()) for p in a]
    theirs = torch.optim.Adam(b, lr=0.01)
    theirs.load_state_dict(ours.state_dict())
    assert all(theirs.state[p]["exp_avg"].dtype == dtype for p in b)
    back = eo.Adam([nn.Parameter(p.detach().clone()) for p in a], lr=0.01)
    back.load_state_dict(theirs.state_dict())
    assert all(s["exp_avg"].dtype == torch.float32 for s in back.state.values())


# ----------------------------------------------------------------------------- sparse, fallback


@pytest.mark.parametrize("cfg", [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True},
                                 {"momentum": 0.5, "dampening": 0.2, "maximize": True}],
                         ids=["plain", "momentum", "nesterov", "dampening-maximize"])
def test_sparse_sgd_equals_torch(cfg: dict) -> None:
    weights = []
    for mod in (eo, torch.optim):
        torch.manual_seed(0)
        emb = nn.Embedding(12, 4, sparse=True)
        opt = mod.SGD(emb.parameters(), lr=0.1, **cfg)
        for k in range(4):
            opt.zero_grad()
            emb(torch.tensor([1, 3, 3, k + 5])).pow(2).sum().backward()
            opt.step()
        weights.append(emb.weight.detach())
        if cfg.get("momentum"):
            assert opt.state[emb.weight]["momentum_buffer"].is_sparse
    assert torch.equal(weights[0], weights[1])


def test_fused_request_for_an_unsupported_dtype_falls_back_and_says_so() -> None:
    a, b = _params(torch.float64), _params(torch.float64)
    import engine.optim.base as base

    base._warned_fallback.clear()
    ours = eo.SGD(a, lr=0.05, momentum=0.9, fused=True)
    with pytest.warns(UserWarning, match="torch.float64 params take the reference path"):
        _run(ours, a, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not per step
        _run(ours, a, STEPS - 1, start=1)
    _run(torch.optim.SGD(b, lr=0.05, momentum=0.9), b, STEPS)
    _assert_equal(a, b, "float64 with fused=True")


# ----------------------------------------------------------------------------- delay options


@pytest.mark.parametrize("cls_name,kw", [
    ("SGD", {"momentum": 0.9, "spike_compensation": True, "delay": 3, "prediction": "linear"}),
    ("SGD", {"momentum": 0.9, "discrepancy_correction": True, "delay": 2}),
    ("Adam", {"spike_compensation": True, "delay": 2, "prediction": "momentum"}),
    ("AdamW", {"discrepancy_correction": True, "delay": 2, "capturable": True}),
])
def test_delay_options_compose_with_complex_and_float64(cls_name: str, kw: dict) -> None:
    """A complex param is updated as torch updates it (Adam: on real views, so a complex run
    equals a float run on the real views bit for bit; SGD: as complex tensors, equal to the
    real-view run up to complex arithmetic's rounding); float64 agrees with float32 to
    float32 precision."""
    cplx = _params(torch.complex128)
    real = [nn.Parameter(torch.view_as_real(p.detach()).clone()) for p in cplx]
    f32 = [nn.Parameter(p.detach().float()) for p in real]
    opts = [getattr(eo, cls_name)(ps, lr=0.01, **kw) for ps in (cplx, real, f32)]
    for k in range(STEPS):
        gs = _grads(cplx, k)
        for pc, pr, pf, g in zip(cplx, real, f32, gs, strict=True):
            pc.grad = g
            pr.grad = torch.view_as_real(g).clone()
            pf.grad = pr.grad.float()
        for opt in opts:
            opt.step()
    as_real = [torch.view_as_real(p) for p in cplx]
    if cls_name == "SGD":
        for x, y in zip(as_real, real, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    else:
        _assert_equal(as_real, real, f"{cls_name} {kw} complex vs real view")
    for pr, pf in zip(real, f32, strict=True):
        torch.testing.assert_close(pr.float(), pf, rtol=1e-5, atol=1e-6)
    if kw.get("prediction"):
        pred_c = opts[0].predicted_weights()
        pred_r = opts[1].predicted_weights()
        for x, y in zip([torch.view_as_real(p) for p in pred_c], pred_r, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
