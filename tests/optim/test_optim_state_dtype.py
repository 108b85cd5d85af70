"""``state_dtype``: SGD/Adam/AdamW moments kept in the params' bf16/fp16 (torch fused's layout).

The contract (docs/ALGORITHMS.md, "Moments in the parameter dtype"): the math is the fp32
math of the default, the moments are loaded up to fp32 and rounded once, to nearest even,
when stored; so the engine computes what torch's fused optimizers compute on bf16 params.
Peers, bf16 params, odd sizes, 12 steps:

* Adam / AdamW (L2 and decoupled decay, AMSGrad): ``torch.optim.Adam/AdamW(fused=True)`` on
  CPU. Measured on this machine: the reference path is bitwise equal (params and moments),
  the Triton kernels (interpreter) within 1 bf16 ulp of the moments (their bias corrections
  come from fp64 exp/log, ~1e-7 relative off the host's powers), params equal. Asserted: at
  most 2 ulps, so a CPU with another vector width does not fail the test on an FMA.
* SGD: torch 2.13's CPU ``fused=True`` SGD does not update the vectorized part of bf16/fp16
  params at all (a torch bug: the first 32 of 33 elements stay unchanged); the peer is
  therefore torch's fused SGD on fp32 upcasts with params and buffer rounded to bf16 after
  every step, which is what its CUDA kernel computes (fp32 opmath, one rounding per store).
  Measured and asserted: the reference bitwise; the kernels within 1 bf16 ulp (their
  ``m * v + (1 - d) * g`` rounds twice where torch CPU fuses a multiply-add: one fp32 ulp
  before the bf16 rounding), or 1e-6 of the scale where a buffer cancels to ~0.
"""

from __future__ import annotations

import os

import pytest
import torch

import engine.optim as eo

BF16 = torch.bfloat16
SIZES = [1, 7, 33, 257]
STEPS = 12
ADAM_CASES = {
    "adam_l2": (eo.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-2)),
    "amsgrad": (eo.Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "adamw": (eo.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-1)),
}
SGD_CASES = {
    "momentum_wd": dict(lr=0.05, momentum=0.9, weight_decay=1e-2),
    "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True),
    "dampening": dict(lr=0.05, momentum=0.9, dampening=0.1),
}
INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two bf16 tensors."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(torch.int16).int()
        return torch.where(i < 0, -32768 - i, i)
    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def assert_close(a: torch.Tensor, b: torch.Tensor, n_ulps: int, what: str = "") -> None:
    """Within ``n_ulps`` bf16 ulps of the tensor's largest magnitude. Not of each element:
    a rounding that went the other way (the kernels' fp32 op order is not torch CPU's, e.g.
    an FMA: one fp32 ulp before the bf16 rounding) leaves a difference of one ulp of the
    buffer's value then, which the momentum carries on (decaying by m per step) while the
    element itself may shrink; near a cancellation to ~0 it is all of that element's bits."""
    a, b = a.float(), b.float()
    scale = float(torch.maximum(a.abs().max(), b.abs().max())) if b.numel() else 0.0
    ulp = 2.0 ** (torch.tensor(max(scale, 1e-30)).log2().floor().item() - 7)
    worst = float((a - b).abs().max()) if b.numel() else 0.0
    assert worst <= n_ulps * ulp, f"{what}: {worst / ulp:.2f} ulps of the scale {scale}"


def _grads(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(BF16) for _ in range(STEPS + 1)]


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("case", sorted(ADAM_CASES))
@pytest.mark.parametrize("n", SIZES)
def test_adam_bf16_state_matches_torch_fused(case: str, n: int, fused: bool) -> None:
    if fused and not INTERP:
        pytest.skip("the Triton path on CPU needs TRITON_INTERPRET=1 (conftest sets it)")
    ours, theirs, kw = ADAM_CASES[case]
    draws = _grads(n, 1000 + n)
    a = draws[0].clone().requires_grad_()
    b = draws[0].clone().requires_grad_()
    oe = ours([a], state_dtype=BF16, fused=fused, **kw)
    ot = theirs([b], fused=True, **kw)
    for g in draws[1:]:
        a.grad, b.grad = g.clone(), g.clone()
        oe.step()
        ot.step()
    if not fused:  # measured: bitwise; asserted with one ulp of room for another CPU's FMA
        assert ulps(a.detach(), b.detach()) <= 1
    assert_close(a.detach(), b.detach(), 1, "param")
    for key, value in ot.state[b].items():
        if key == "step":
            assert float(oe.state[a]["step"]) == float(value)
            continue
        assert oe.state[a][key].dtype == BF16, key
        assert_close(oe.state[a][key], value, 1, key)


def _sgd_peer(p0: torch.Tensor, draws: list[torch.Tensor], kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused SGD as its CUDA kernel runs it on bf16: fp32 math, bf16 storage."""
    p = p0.clone().requires_grad_()
    buf = None
    for g in draws:
        w = p.detach().float().requires_grad_()
        opt = torch.optim.SGD([w], fused=True, **kw)
        if buf is not None:
            opt.state[w]["momentum_buffer"] = buf.float()
        w.grad = g.float()
        opt.step()
        p = w.detach().to(BF16)
        buf = opt.state[w]["momentum_buffer"].to(BF16)
    return p, buf


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("case", sorted(SGD_CASES))
@pytest.mark.parametrize("n", SIZES)
def test_sgd_bf16_state_matches_torch_fused_math(case: str, n: int, fused: bool) -> None:
    if fused and not INTERP:
        pytest.skip("the Triton path on CPU needs TRITON_INTERPRET=1 (conftest sets it)")
    kw = SGD_CASES[case]
    draws = _grads(n, 2000 + n)
    a = draws[0].clone().requires_grad_()
    opt = eo.SGD([a], state_dtype="param", fused=fused, **kw)
    for g in draws[1:]:
        a.grad = g.clone()
        opt.step()
    p, buf = _sgd_peer(draws[0], draws[1:], kw)
    assert opt.state[a]["momentum_buffer"].dtype == BF16
    if not fused:  # the same torch ops on the same values: bitwise
        assert torch.equal(a.detach(), p)
        assert torch.equal(opt.state[a]["momentum_buffer"], buf)
    # the kernel's m * v + (1 - d) * g is not torch CPU's fused multiply-add: 1 fp32 ulp
    # apart before the rounding, so 1 bf16 ulp (or ~0 where v cancels), then compounding
    assert_close(a.detach(), p, 1, "param")
    assert_close(opt.state[a]["momentum_buffer"], buf, 1, "momentum_buffer")


def test_kernels_and_reference_agree_on_several_tensors_with_the_mitigations() -> None:
    """Multi-tensor launch (several params, one group) against the reference, with spike
    compensation, prediction and PipeMare's delta on: those run in the chosen dtype (the
    moments bf16; delta and last_update stay fp32, they carry exact contracts)."""
    if not INTERP:
        pytest.skip("needs TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(7)
    shapes = [(3, 5), (17,), (129,)]
    for cls, kw in [
        (eo.SGD, dict(lr=0.05, momentum=0.9, spike_compensation=True, delay=2,
                      prediction="momentum", discrepancy_correction=True,
                      delay_compensation=0.1)),
        (eo.AdamW, dict(lr=1e-2, spike_compensation=True, delay=2, prediction="linear",
                        discrepancy_correction=True)),
    ]:
        init = [torch.randn(s, generator=gen).to(BF16) for s in shapes]
        grads = [[torch.randn(s, generator=gen).to(BF16) for s in shapes] for _ in range(4)]
        results = []
        for fused in (False, True):
            ps = [t.clone().requires_grad_() for t in init]
            opt = cls(ps, state_dtype=BF16, fused=fused, **kw)
            for gs in grads:
                for p, g in zip(ps, gs):
                    p.grad = g.clone()
                opt.step()
            results.append((ps, opt))
        (ref_ps, ref), (ker_ps, ker) = results
        for pr, pk in zip(ref_ps, ker_ps):
            assert_close(pr.detach(), pk.detach(), 2, "param")
            for key, value in ref.state[pr].items():
                if key == "step":
                    continue
                expect = BF16 if key in ("momentum_buffer", "exp_avg", "exp_avg_sq") else torch.float32
                assert value.dtype == expect == ker.state[pk][key].dtype, key
            # the in-step prediction is what an on-demand prediction from the state gives
        for opt in (ref, ker):
            for cached, recomputed in zip(opt.predicted_weights(), opt.predicted_weights(horizon=2)):
                assert torch.equal(cached, recomputed)


def test_default_and_float32_keep_fp32_moments_and_param_keeps_fp32_for_fp32_params() -> None:
    p16 = torch.zeros(5, dtype=BF16, requires_grad=True)
    p32 = torch.zeros(5, requires_grad=True)
    for choice in (None, torch.float32):
        opt = eo.Adam([p16], state_dtype=choice)
        p16.grad = torch.ones_like(p16)
        opt.step()
        assert opt.state[p16]["exp_avg"].dtype == torch.float32
    opt = eo.SGD([p16, p32], lr=0.1, momentum=0.9, state_dtype="param")
    p16.grad, p32.grad = torch.ones_like(p16), torch.ones_like(p32)
    opt.step()
    assert opt.state[p16]["momentum_buffer"].dtype == BF16
    assert opt.state[p32]["momentum_buffer"].dtype == torch.float32
    # an explicit bf16 choice applies to bf16 params only (fp16 keeps fp32 moments)
    p_half = torch.zeros(5, dtype=torch.float16, requires_grad=True)
    opt = eo.SGD([p16, p_half], lr=0.1, momentum=0.9, state_dtype=BF16)
    p16.grad, p_half.grad = torch.ones_like(p16), torch.ones_like(p_half)
    opt.step()
    assert opt.state[p_half]["momentum_buffer"].dtype == torch.float32


def test_state_dict_keeps_the_dtype_and_a_load_converts() -> None:
    p = torch.randn(9).to(BF16).requires_grad_()
    opt = eo.AdamW([p], lr=1e-2, state_dtype=BF16)
    for _ in range(2):
        p.grad = torch.randn(9).to(BF16)
        opt.step()
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == BF16
    assert sd["param_groups"][0]["state_dtype"] is BF16

    # the checkpoint's group options win (torch's rule for every option): bf16 again
    q = p.detach().clone().requires_grad_()
    other = eo.AdamW([q], lr=1e-2)
    other.load_state_dict(sd)
    assert other.state[q]["exp_avg"].dtype == BF16
    assert torch.equal(other.state[q]["exp_avg"], opt.state[p]["exp_avg"])

    # a checkpoint without the option (torch's, or saved before it existed) follows this
    # optimizer's default: converted to fp32 exactly (bf16 -> fp32 is exact)
    legacy = {"state": sd["state"],
              "param_groups": [{k: v for k, v in sd["param_groups"][0].items() if k != "state_dtype"}]}
    fp32 = eo.AdamW([q], lr=1e-2)
    fp32.load_state_dict(legacy)
    assert fp32.state[q]["exp_avg"].dtype == torch.float32
    assert torch.equal(fp32.state[q]["exp_avg"], opt.state[p]["exp_avg"].float())

    # editing the option between steps converts the state (rounded to nearest even)
    fp32.param_groups[0]["state_dtype"] = "param"
    q.grad = torch.randn(9).to(BF16)
    fp32.step()
    assert fp32.state[q]["exp_avg"].dtype == BF16


def test_torch_fused_bf16_checkpoint_loads_both_ways() -> None:
    p = torch.randn(6).to(BF16).requires_grad_()
    t = torch.optim.Adam([p], lr=1e-2, fused=True)
    p.grad = torch.randn(6).to(BF16)
    t.step()
    q = p.detach().clone().requires_grad_()
    ours = eo.Adam([q], lr=1e-2, state_dtype=BF16)
    ours.load_state_dict(t.state_dict())
    assert ours.state[q]["exp_avg_sq"].dtype == BF16
    assert torch.equal(ours.state[q]["exp_avg_sq"], t.state[p]["exp_avg_sq"])
    back = torch.optim.Adam([p], lr=1e-2, fused=True)
    back.load_state_dict(ours.state_dict())
    assert back.state[p]["exp_avg"].dtype == BF16


@pytest.mark.parametrize("bad", ["bf16", torch.int8, torch.float64, 16])
def test_bad_state_dtype_is_refused_naming_the_option(bad: object) -> None:
    p = torch.zeros(3, dtype=BF16, requires_grad=True)
    with pytest.raises(ValueError, match="state_dtype"):
        eo.SGD([p], lr=0.1, momentum=0.9, state_dtype=bad)


def test_state_dtype_refused_where_it_does_not_apply() -> None:
    p = torch.zeros(3, dtype=BF16, requires_grad=True)
    with pytest.raises(ValueError, match="differentiable"):
        eo.Adam([p], state_dtype=BF16, differentiable=True)
    with pytest.raises(ValueError, match="state_dtype.*NAdam"):
        eo.NAdam([{"params": [p], "state_dtype": BF16}])
    opt = eo.SGD([p], lr=0.1, momentum=0.9)
    opt.param_groups[0]["state_dtype"] = "half"
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="param_groups\\[0\\]: state_dtype='half'"):
        opt.step()
    assert not opt.state  # nothing changed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run .ci/gpu on a GPU machine)")
@pytest.mark.parametrize("case", ["sgd", "adam_l2", "amsgrad", "adamw"])
@pytest.mark.parametrize("n", [1, 4099, (1 << 20) + 3])
def test_cuda_bf16_state_matches_torch_fused_on_the_gpu(case: str, n: int) -> None:
    """The Triton kernels on a GPU against torch's CUDA fused optimizers on bf16 params, where
    torch's fused SGD is correct too: within 1 bf16 ulp of the scale (the CPU bound; an FMA
    the GPU compiler contracts differently from torch's kernel moves a rounding by one);
    AdamW within 2: its decoupled decay is one more product per step that the two kernels
    may round differently, and over 3 steps of 2^20 + 3 elements one element drifted by
    two ulps of the scale (H100, 2026-11-26: 2.00 ulps of 4.94)."""
    if case == "sgd":
        ours, theirs, kw = eo.SGD, torch.optim.SGD, SGD_CASES["momentum_wd"]
    else:
        ours, theirs, kw = ADAM_CASES[case]
    draws = [t.cuda() for t in _grads(n, 3000 + n)]  # drawn on the CPU, then moved
    a = draws[0].clone().requires_grad_()
    b = draws[0].clone().requires_grad_()
    oe = ours([a], state_dtype=BF16, **kw)  # fused=None: Triton on CUDA
    ot = theirs([b], fused=True, **kw)
    for g in draws[1:]:
        a.grad, b.grad = g.clone(), g.clone()
        oe.step()
        ot.step()
    ulps = 2 if case == "adamw" else 1
    assert_close(a.detach(), b.detach(), ulps, "param")
    for key, value in ot.state[b].items():
        if key != "step":
            assert oe.state[a][key].dtype == BF16, key
            assert_close(oe.state[a][key], value, ulps, key)


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "triton"])
def test_flat_bucket_keeps_one_bf16_state_buffer(fused: bool) -> None:
    """After engine.flatten_ the moments are views of one flat bf16 buffer, and the flat update
    computes what the per-tensor reference computes on the same tensors."""
    if fused and not INTERP:
        pytest.skip("needs TRITON_INTERPRET=1")
    import engine

    gen = torch.Generator().manual_seed(11)
    shapes = [(5, 3), (31,), (2, 2, 2)]
    init = [torch.randn(s, generator=gen).to(BF16) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(BF16) for s in shapes] for _ in range(3)]
    flat = [torch.nn.Parameter(t.clone()) for t in init]
    engine.flatten_(flat, name=f"state-dtype-{fused}")
    plain = [t.clone().requires_grad_() for t in init]
    for cls, kw in [(eo.SGD, dict(lr=0.05, momentum=0.9)), (eo.AdamW, dict(lr=1e-2))]:
        for p, q in zip(flat, plain):
            p.data.copy_(q.detach())
        of = cls(flat, state_dtype="param", fused=fused, **kw)
        op = cls(plain, state_dtype="param", fused=False, **kw)
        for gs in grads:
            for p, q, g in zip(flat, plain, gs):
                p.grad = g.clone()
                q.grad = g.clone()
            of.step()
            op.step()
        key = "momentum_buffer" if cls is eo.SGD else "exp_avg"
        assert len({of.state[p][key].untyped_storage().data_ptr() for p in flat}) == 1
        for p, q in zip(flat, plain):
            assert of.state[p][key].dtype == BF16
            if fused:
                assert_close(p.detach(), q.detach(), 1, "param")
            else:
                assert torch.equal(p.detach(), q.detach())
                assert torch.equal(of.state[p][key], op.state[q][key])


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "triton"])
def test_fp16_moments_match_torch_fused_adamw(fused: bool) -> None:
    """fp16 params with state_dtype="param": fp16 moments, against torch's CPU fused AdamW
    (measured bitwise on both paths; asserted bitwise for the reference, within a bf16 ulp of
    the scale, a looser bound than fp16's, for the kernels)."""
    if fused and not INTERP:
        pytest.skip("needs TRITON_INTERPRET=1")
    draws = [t.half() for t in _grads(257, 4000)]
    a = draws[0].clone().requires_grad_()
    b = draws[0].clone().requires_grad_()
    oe = eo.AdamW([a], lr=1e-2, state_dtype="param", fused=fused)
    ot = torch.optim.AdamW([b], lr=1e-2, fused=True)
    for g in draws[1:]:
        a.grad, b.grad = g.clone(), g.clone()
        oe.step()
        ot.step()
    for ours, theirs in ((a.detach(), b.detach()), (oe.state[a]["exp_avg"], ot.state[b]["exp_avg"]),
                         (oe.state[a]["exp_avg_sq"], ot.state[b]["exp_avg_sq"])):
        assert ours.dtype == torch.float16
        if fused:
            assert_close(ours, theirs, 1)
        else:
            assert torch.equal(ours, theirs)
