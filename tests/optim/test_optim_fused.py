"""Fused (Triton, interpreted on CPU) vs reference optimizer, the fused/reference dispatch, and
the flat-buffer (arena) path vs the per-tensor path.

Every test that launches the kernels builds its model on the kernel-test device
(tests/kernel_support.py): CPU under the interpreter, CUDA on a GPU machine, where Triton is
compiled and refuses CPU tensors. Without either, those tests skip with the reason.
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch
from kernel_support import DEVICE, needs_kernels
from torch import nn

import engine.optim as eo
from engine.optim.dispatch import _Fused

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=8e-3, atol=1e-3)}
STATE_TOL = dict(rtol=1e-4, atol=1e-6)  # state is fp32 for every param dtype


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu") -> nn.Module:
    torch.manual_seed(seed)  # initialized on CPU, then moved: the same weights on every device
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)).to(device, dtype)


def batches(n: int, dtype: torch.dtype = torch.float32, seed: int = 1, device="cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 7, generator=g).to(device, dtype) for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, xs, set_to_none: bool = True) -> None:
    for x in xs:
        opt.zero_grad(set_to_none=set_to_none)
        model(x).float().sin().sum().backward()
        opt.step()


OPTIONS = {
    eo.SGD: [
        dict(lr=0.05, momentum=0.9, weight_decay=0.01),
        dict(lr=0.05),
        dict(lr=0.05, momentum=0.9, nesterov=True),
        dict(lr=0.05, momentum=0.8, dampening=0.2, maximize=True),
        dict(lr=0.05, momentum=0.9, delay=3, spike_compensation=True),
        dict(lr=0.05, momentum=0.9, delay=2, prediction="linear"),
        dict(lr=0.05, momentum=0.9, delay=2, prediction="momentum", discrepancy_correction=True),
        dict(lr=0.05, momentum=0.9, delay=3, delay_compensation=2.0, weight_decay=0.01),
    ],
    eo.Adam: [
        dict(lr=0.01, weight_decay=0.1),
        dict(lr=0.01, amsgrad=True, maximize=True),
        dict(lr=0.01, delay=2, spike_compensation=True),
        dict(lr=0.01, delay=2, prediction="linear", discrepancy_correction=True),
        dict(lr=0.01, delay=2, prediction="momentum"),
    ],
    eo.AdamW: [
        dict(lr=0.01, amsgrad=True),
        dict(lr=0.01, delay=3, spike_compensation=True, prediction="linear", discrepancy_correction=True),
        dict(lr=0.01, delay=2, discrepancy_correction=True, delay_compensation=5.0),
    ],
}
CASES = [(cls, cfg) for cls, cfgs in OPTIONS.items() for cfg in cfgs]


def _ids(case) -> str:
    cls, cfg = case
    return cls.__name__ + "-" + "-".join(f"{k}={v}" for k, v in cfg.items() if k != "lr")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_fused_matches_reference(case, dtype: torch.dtype) -> None:
    cls, cfg = case
    ref, fus = make_model(dtype=dtype, device=DEVICE), make_model(dtype=dtype, device=DEVICE)
    opt_r = cls(ref.parameters(), fused=False, **cfg)
    opt_f = cls(fus.parameters(), fused=True, **cfg)
    xs = batches(3, dtype, device=DEVICE)
    train(ref, opt_r, xs)
    train(fus, opt_f, xs)
    initial = make_model(dtype=dtype, device=DEVICE).parameters()
    for p, q, p0 in zip(ref.parameters(), fus.parameters(), initial, strict=True):
        torch.testing.assert_close(q, p, **TOL[dtype])
        assert not torch.equal(q, p0)  # the weights moved: the comparison is not vacuous
        for key, value in opt_r.state[p].items():
            torch.testing.assert_close(opt_f.state[q][key], value, **STATE_TOL)
    for u, v in zip(opt_r.predicted_weights(), opt_f.predicted_weights(), strict=True):
        torch.testing.assert_close(v, u, **TOL[dtype])
    for u, v in zip(opt_r.backward_weights(), opt_f.backward_weights(), strict=True):
        torch.testing.assert_close(v, u, **TOL[dtype])


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every call into the fused kernels (and still runs them)."""
    calls: list[str] = []
    original = _Fused.__call__

    def spy(self, *args, **kwargs):
        calls.append(self.family)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_Fused, "__call__", spy)
    return calls


@pytest.mark.parametrize("fused", [None, False, pytest.param(True, marks=needs_kernels)])
def test_dispatch_on_the_kernel_device(fused, fused_calls: list[str]) -> None:
    """fused=None: the kernels for CUDA tensors, the reference for CPU ones; True/False force."""
    launches = fused is True or (fused is None and DEVICE.type == "cuda")
    model = make_model(device=DEVICE)
    opt = eo.Adam(model.parameters(), fused=fused)
    train(model, opt, batches(1, device=DEVICE))
    # one multi-tensor launch for the group's 4 params (no arena)
    assert len(fused_calls) == (1 if launches else 0)


def test_fused_true_on_cpu_without_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"fused=True with CPU tensors.*TRITON_INTERPRET=1.*fused=False"):
        eo.SGD(make_model().parameters(), lr=0.1, fused=True)
    # fused=None stays the reference path on CPU and needs no interpreter
    eo.SGD(make_model().parameters(), lr=0.1, fused=None)


@needs_kernels
def test_zero_size_and_non_contiguous_params_fall_back_to_reference(fused_calls: list[str]) -> None:
    torch.manual_seed(0)
    empty = nn.Parameter(torch.zeros(0, 4, device=DEVICE))
    strided = nn.Parameter(torch.randn(4, 3).to(DEVICE).t())  # non-contiguous view
    plain = nn.Parameter(torch.randn(5).to(DEVICE))
    assert not strided.is_contiguous()
    ref = [nn.Parameter(t.detach().clone()) for t in (empty, strided, plain)]
    opt = eo.Adam([empty, strided, plain], lr=0.1, fused=True)
    opt_r = eo.Adam(ref, lr=0.1, fused=False)
    for ps, o in (([empty, strided, plain], opt), (ref, opt_r)):
        for p in ps:
            p.grad = torch.ones_like(p)
        o.step()
    assert fused_calls == ["adam"]  # only the contiguous, non-empty param
    assert opt.state[empty]["step"].item() == 1
    for p, q in zip([empty, strided, plain], ref, strict=True):
        torch.testing.assert_close(p, q)


# ----------------------------------------------------------------------------- flat path


def _arena():
    try:
        import engine._C  # noqa: F401
        import engine.arena as arena
    except ImportError as exc:  # pragma: no cover - depends on the build
        pytest.skip(f"engine._C is not built ({exc}); run `python setup.py build_ext --inplace`")
    return arena


def _count_calls(opt) -> list[int]:
    sizes: list[int] = []
    original = opt._call_update

    def counting(fn, group, param, *rest):
        sizes.append(param.numel())
        return original(fn, group, param, *rest)

    opt._call_update = counting
    return sizes


FLAT_CASES = [
    (eo.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01, delay=2, spike_compensation=True,
                  prediction="linear", discrepancy_correction=True)),
    (eo.Adam, dict(lr=0.01, amsgrad=True, delay=2, prediction="momentum", discrepancy_correction=True)),
    (eo.AdamW, dict(lr=0.01, delay=1, spike_compensation=True)),
]


@pytest.mark.parametrize("set_to_none", [False, True], ids=["grads-kept", "grads-dropped"])
@pytest.mark.parametrize(
    "fused", [False, pytest.param(True, marks=needs_kernels)], ids=["reference", "fused"])
@pytest.mark.parametrize("cls,cfg", FLAT_CASES, ids=[c.__name__ for c, _ in FLAT_CASES])
def test_flat_path_equals_per_tensor_path(cls, cfg: dict, fused: bool, set_to_none: bool) -> None:
    arena = _arena()
    per, flat = make_model(device=DEVICE), make_model(device=DEVICE)
    arena.flatten_(flat)
    opt_p = cls(per.parameters(), fused=fused, **cfg)
    opt_f = cls(flat.parameters(), fused=fused, **cfg)
    sizes = _count_calls(opt_f)
    xs = batches(3, device=DEVICE)
    train(per, opt_p, xs, set_to_none)
    train(flat, opt_f, xs, set_to_none)
    n_flat = arena.flat_buffers_for(list(flat.parameters())).param.numel()
    assert sizes == [n_flat] * 3  # one call per step, over the whole flat buffer
    # elementwise math over a flat buffer is the same math: bit for bit
    for p, q in zip(per.parameters(), flat.parameters(), strict=True):
        assert torch.equal(p, q)
    sp, sf = opt_p.state_dict(), opt_f.state_dict()
    assert sp["state"].keys() == sf["state"].keys()
    for pid, entry in sp["state"].items():
        assert entry.keys() == sf["state"][pid].keys()
        for key, value in entry.items():
            assert torch.equal(sf["state"][pid][key], value), key  # torch's per-param layout
    for u, v in zip(opt_p.predicted_weights(), opt_f.predicted_weights(), strict=True):
        assert torch.equal(u, v)
    for u, v in zip(opt_p.backward_weights(), opt_f.backward_weights(), strict=True):
        assert torch.equal(u, v)


def test_flat_state_dict_round_trip_and_missing_grads() -> None:
    arena = _arena()
    cfg = dict(lr=0.01, delay=2, prediction="linear", discrepancy_correction=True)
    a, b = make_model(), make_model()
    arena.flatten_(a)
    arena.flatten_(b)
    opt_a = eo.Adam(a.parameters(), **cfg)
    train(a, opt_a, batches(2))
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    with torch.no_grad():
        for p, q in zip(b.parameters(), a.parameters(), strict=True):
            p.copy_(q)
    opt_b = eo.Adam(b.parameters(), lr=1.0)
    opt_b.load_state_dict(torch.load(buf, weights_only=False))
    sizes = _count_calls(opt_b)
    xs = batches(2, seed=7)
    train(a, opt_a, xs)
    train(b, opt_b, xs)
    assert len(sizes) == 2  # loaded per-param state was gathered back into flat buffers
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    # a param without grad: torch skips it, so the flat update (which would decay and move
    # it) is not used for that group; the param stays put
    frozen_bias = list(b.parameters())[-1]
    before = frozen_bias.detach().clone()
    opt_b.zero_grad(set_to_none=True)
    b[0](batches(1)[0]).sum().backward()  # only the first layer gets grads
    opt_b.step()
    assert frozen_bias.grad is None and torch.equal(frozen_bias, before)
    assert len(sizes) == 4  # the two first-layer params, one call each


def test_plain_models_never_load_the_arena() -> None:
    """engine.optim finds flat buffers only through a flattened parameter's own arena link:
    a plain model never imports engine.arena or the compiled extension (and a broken
    extension cannot break a drop-in optimizer)."""
    code = (
        "import sys, torch, engine.optim as eo\n"
        "m = torch.nn.Linear(3, 2)\n"
        "opt = eo.SGD(m.parameters(), lr=0.1, momentum=0.9)\n"
        "m(torch.randn(4, 3)).sum().backward(); opt.step()\n"
        "assert 'engine.arena' not in sys.modules and 'engine._C' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.cuda
@pytest.mark.parametrize("case", [CASES[0], CASES[6], CASES[8], CASES[-1]], ids=[_ids(c) for c in (CASES[0], CASES[6], CASES[8], CASES[-1])])
def test_cuda_auto_fused_matches_cpu_reference(case, fused_calls: list[str]) -> None:
    """fused=None on CUDA tensors runs the compiled Triton kernels (one multi-tensor launch
    per group and step); results match the CPU reference path."""
    cls, cfg = case
    ref, gpu = make_model(), make_model().cuda()
    opt_r = cls(ref.parameters(), fused=False, **cfg)
    opt_g = cls(gpu.parameters(), **cfg)
    xs = batches(3)
    train(ref, opt_r, xs)
    train(gpu, opt_g, [x.cuda() for x in xs])
    assert len(fused_calls) == 3  # one multi-tensor launch per step
    for p, q in zip(ref.parameters(), gpu.parameters(), strict=True):
        torch.testing.assert_close(q.cpu(), p, **TOL[torch.float32])
    for u, v in zip(opt_r.predicted_weights(), opt_g.predicted_weights(), strict=True):
        torch.testing.assert_close(v.cpu(), u, **TOL[torch.float32])
    for u, v in zip(opt_r.backward_weights(), opt_g.backward_weights(), strict=True):
        torch.testing.assert_close(v.cpu(), u, **TOL[torch.float32])
