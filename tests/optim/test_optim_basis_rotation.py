"""engine.optim.BasisRotation (Jung, Shin, Lee, ICML 2026) against a slow float64 reference
written from docs/ALGORITHMS.md ("Basis rotation"), against torch's AdamW where it must equal
it, under PipeDream stashing and pb, through a state_dict, and with bad options refused."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from test_runtime_support import data, make_pipe
from test_runtime_versions import check_versions, run

import engine
import engine.optim
from engine.cli.config import CLIError, TrainConfig, check_config
from engine.optim import BasisRotation

HP = {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def _grads(shape, steps, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype) for _ in range(steps)]


def _train(params, grads_per_param, steps, **kw):
    opt = BasisRotation(params, **kw)
    for t in range(steps):
        for p, gs in zip(params, grads_per_param, strict=True):
            p.grad = gs[t].to(p.dtype)
        opt.step()
    return opt


def reference(w0, grads, lr, betas, eps, weight_decay, T, geometry="bi", shampoo_beta=None):
    """The documented update, written out step by step in float64 with Python loops for the
    Rayleigh quotients and the permutation (slow; independent of the module's code)."""
    b1, b2 = betas
    bs = b2 if shampoo_beta is None else shampoo_beta
    W = w0.double().clone()
    r, c = W.shape
    left = geometry == "bi" or r < c
    right = geometry == "bi" or r >= c
    L, R = torch.zeros(r, r, dtype=torch.float64), torch.zeros(c, c, dtype=torch.float64)
    m, v = torch.zeros_like(W), torch.zeros_like(W)
    QL, QR = torch.eye(r, dtype=torch.float64), torch.eye(c, dtype=torch.float64)
    for t, G in enumerate(grads, 1):
        G = G.double()
        L = bs * L + (1 - bs) * (G @ G.T)
        R = bs * R + (1 - bs) * (G.T @ G)
        sides = [(L, "L", 0)] * left + [(R, "R", 1)] * right
        for M, name, dim in sides:
            if t == 1:
                vals, vecs = torch.linalg.eigh(M)
                Q = vecs[:, [int(i) for i in torch.argsort(vals, descending=True, stable=True)]]
            elif t % T == 0:
                Q = QL if name == "L" else QR
                est = [float(Q[:, k] @ M @ Q[:, k]) for k in range(Q.shape[1])]
                order = sorted(range(len(est)), key=lambda k: -est[k])
                v = v[order, :] if dim == 0 else v[:, order]
                Q = torch.linalg.qr(M @ Q[:, order]).Q
            else:
                continue
            if name == "L":
                QL = Q
            else:
                QR = Q
        m = b1 * m + (1 - b1) * G
        v = b2 * v + (1 - b2) * (QL.T @ G @ QR) ** 2
        U = QL @ ((QL.T @ m @ QR) / (v.sqrt() + eps)) @ QR.T
        W = W * (1 - lr * weight_decay) - lr * math.sqrt(1 - b2**t) / (1 - b1**t) * U
    return W, L, R


# Shapes whose rotated covariances are full rank from step 1: for a non-square G under "bi",
# G G^T or G^T G is rank-deficient at step 1 and eigh's basis of its null space is arbitrary
# (rounding picks it), so two exact implementations may differ there (ALGORITHMS.md).
@pytest.mark.parametrize("shape,geometry,shampoo_beta", [
    ((4, 4), "bi", None), ((5, 5), "bi", 0.5), ((4, 4), "uni", None), ((3, 6), "uni", 0.5),
    ((6, 3), "uni", None)])
def test_rotated_update_equals_the_float64_reference(shape, geometry, shampoo_beta):
    steps, T = 7, 3
    grads = _grads(shape, steps)
    w0 = torch.randn(*shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    kw = {"precondition_frequency": T, "rotation_geometry": geometry, "shampoo_beta": shampoo_beta}
    want, L, R = reference(w0, grads, T=T, geometry=geometry, shampoo_beta=shampoo_beta, **HP)
    p = torch.nn.Parameter(w0.clone())
    state = _train([p], [grads], steps, **kw, **HP).state[p]
    for key, value in (("L", L), ("R", R)):
        if key in state:
            torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-12)
    # With both bases exact at step 1, Q_L^T G Q_R is diagonal: its off-diagonal entries are
    # rounding noise, and Adam divides them by |noise| + eps, so the op order's rounding
    # (1e-16) shows up amplified by 1/eps (1e-8 relative). In float32 the same noise exceeds
    # eps and those coordinates take sign-like steps: only "uni" compares in float32.
    torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-8)
    if geometry == "uni" and shape[0] == shape[1]:
        p32 = torch.nn.Parameter(w0.float())
        _train([p32], [grads], steps, **kw, **HP)
        torch.testing.assert_close(p32.detach().double(), want, rtol=1e-4, atol=1e-5)


def test_uni_keeps_only_the_smaller_side():
    ps = [torch.nn.Parameter(torch.zeros(*s)) for s in ((3, 5), (5, 3), (4, 4))]
    opt = _train(ps, [_grads(p.shape, 1, dtype=torch.float32) for p in ps], 1,
                 rotation_geometry="uni")
    keys = [sorted(k for k in opt.state[p] if k in ("L", "R", "Q_L", "Q_R")) for p in ps]
    assert keys == [["L", "Q_L"], ["Q_R", "R"], ["Q_R", "R"]]


def test_bases_change_only_at_step_one_and_every_T_steps():
    p = torch.nn.Parameter(torch.zeros(4, 3))
    opt = BasisRotation([p], precondition_frequency=3)
    seen = []
    for g in _grads((4, 3), 7, dtype=torch.float32):
        p.grad = g
        opt.step()
        seen.append((opt.state[p]["Q_L"].clone(), opt.state[p]["Q_R"].clone()))
    changed = [t + 1 for t in range(1, 7)
               if not all(torch.equal(a, b) for a, b in zip(seen[t], seen[t - 1], strict=True))]
    assert changed == [3, 6]


def test_with_the_identity_basis_it_is_adamw_with_the_source_eps():
    """Diagonal gradients with a fixed descending order keep both bases the identity (up to
    signs, which cancel); the update is then AdamW with eps_t = eps / sqrt(1 - b2^t)."""
    n, steps = 4, 6
    g = torch.Generator().manual_seed(3)
    grads = [torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0]) * (1 + 0.1 * torch.rand(n, generator=g)))
             for _ in range(steps)]
    w0 = torch.randn(n, n, generator=g)
    p = torch.nn.Parameter(w0.clone())
    q = torch.nn.Parameter(w0.clone())
    opt = BasisRotation([p], precondition_frequency=2, **{**HP, "eps": 1e-30})
    ref = torch.optim.AdamW([q], **{**HP, "eps": 1e-30})
    for G in grads:
        p.grad, q.grad = G.clone(), G.clone()
        opt.step()
        ref.step()
        for key in ("Q_L", "Q_R"):
            assert torch.equal(opt.state[p][key].abs(), torch.eye(n)), key
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_other_parameters_take_torch_adamw_bit_for_bit(dtype):
    """1-D params, matrices above max_dim and rotate=False groups: torch.optim.AdamW exactly
    (its fused kernel for fp32/fp64, its single-tensor path for complex)."""
    torch.manual_seed(0)
    shapes = [(7,), (3, 9), (2, 2)]
    ours = [torch.nn.Parameter(torch.randn(*s, dtype=dtype)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = BasisRotation([{"params": ours[:2], "max_dim": 8}, {"params": ours[2:], "rotate": False}], **HP)
    ref = torch.optim.AdamW(theirs, **HP, fused=not dtype.is_complex)
    for _ in range(4):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, dtype=dtype)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        assert not any(k in opt.state[a] for k in ("L", "R", "Q_L", "Q_R"))


def test_bf16_params_keep_fp32_state_and_round_once():
    g = _grads((4, 3), 3, dtype=torch.float32)
    w0 = torch.randn(4, 3).bfloat16()
    p16 = torch.nn.Parameter(w0.clone())
    opt16 = BasisRotation([p16], **HP)
    p32 = torch.nn.Parameter(w0.float())
    opt32 = BasisRotation([p32], **HP)
    for G in g:
        p16.grad = G.bfloat16()
        p32.grad = G.bfloat16().float()
        opt16.step()
        opt32.step()
        assert torch.equal(p16, p32.detach().bfloat16())
        p32.data.copy_(p16.detach().float())  # both continue from the stored bf16 weight
    assert all(t.dtype == torch.float32 for k, t in opt16.state[p16].items())


def test_state_dict_round_trip_continues_bitwise():
    shapes = [(4, 3), (5,), (3, 3)]
    grads = [_grads(s, 8, seed=i, dtype=torch.float32) for i, s in enumerate(shapes)]
    ps = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = _train(ps, grads, 4, precondition_frequency=3, rotation_geometry="uni", **HP)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    other = BasisRotation(qs, precondition_frequency=3, rotation_geometry="uni", **HP)
    buf.seek(0)
    other.load_state_dict(torch.load(buf))
    for t in range(4, 8):  # step 6 refreshes the bases from the loaded covariances
        for a, b, gs in zip(ps, qs, grads, strict=True):
            a.grad, b.grad = gs[t].clone(), gs[t].clone()
        opt.step()
        other.step()
    for a, b in zip(ps, qs, strict=True):
        assert torch.equal(a, b)
        for key, value in opt.state[a].items():
            assert torch.equal(value, other.state[b][key]), key


@pytest.mark.parametrize(
    "kw,name",
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"betas": (0.9,)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"shampoo_beta": 1.5}, "shampoo_beta"),
        ({"precondition_frequency": 0}, "precondition_frequency"),
        ({"precondition_frequency": 2.0}, "precondition_frequency"),
        ({"rotation_geometry": "left"}, "rotation_geometry"),
        ({"max_dim": 0}, "max_dim"),
        ({"rotate": 1}, "rotate"),
        ({"delay": -1}, "delay"),
    ],
)
def test_bad_options_are_refused_by_name_and_change_nothing(kw, name):
    with pytest.raises(ValueError, match=rf"^{name}="):
        BasisRotation([torch.nn.Parameter(torch.zeros(2, 2))], **kw)
    p = torch.nn.Parameter(torch.ones(3, 2))
    opt = _train([p], [_grads((3, 2), 2, dtype=torch.float32)], 2)
    before = (p.detach().clone(), copy.deepcopy(opt.state_dict()))
    opt.param_groups[0].update(kw)  # edited into a bad state between steps
    p.grad = torch.ones(3, 2)
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: {name}="):
        opt.step()
    assert torch.equal(p, before[0])
    assert all(torch.equal(v, before[1]["state"][0][k]) for k, v in opt.state[p].items())


def test_switching_a_stepped_matrix_between_paths_is_refused():
    p = torch.nn.Parameter(torch.ones(3, 2))
    opt = _train([p], [_grads((3, 2), 1, dtype=torch.float32)], 1)
    w = p.detach().clone()
    opt.param_groups[0]["rotate"] = False
    p.grad = torch.ones(3, 2)
    with pytest.raises(ValueError, match=r"params\[0\] \(\(3, 2\)\) was stepped with rotation"):
        opt.step()
    assert torch.equal(p, w) and int(opt.state[p]["step"]) == 1


def test_memory_bytes_counts_the_rotation_state():
    p, b = torch.nn.Parameter(torch.zeros(6, 4)), torch.nn.Parameter(torch.zeros(4))
    opt = _train([p, b], [_grads((6, 4), 1, dtype=torch.float32), _grads((4,), 1, dtype=torch.float32)], 1)
    assert opt.memory_bytes() == {"moments": 4 * 2 * (24 + 4), "rotation": 4 * 2 * (36 + 16)}


@pytest.mark.parametrize("schedule", ["pipedream", "pb"])
def test_trains_under_stashing_and_pb_reading_the_scheduled_versions(schedule):
    """The schedules the paper runs it under (PipeDream stashing) and pb: every micro-batch
    reads the weight versions ALGORITHMS.md's tables give; its 2-D weights are rotated."""
    def make(params):
        return BasisRotation(params, lr=0.01, betas=(0.9, 0.999), precondition_frequency=2)

    pipe, got, hist, N = run(3, 3, schedule, make)
    check_versions(pipe, got, hist, N, schedule)
    for st in pipe.stages:
        opt = st.optimizer
        (matrix,) = [p for p in opt.param_groups[0]["params"] if p.dim() == 2]
        state = opt.state[matrix]
        assert {"Q_L", "Q_R"} <= set(state) and int(state["step"]) == len(hist.w[0]) - 1
        assert opt.param_groups[0]["delay"] == pipe.delays[pipe.stages.index(st)]


def test_pipeline_checkpoint_keeps_the_rotation_state(tmp_path):
    """engine.save/load carry the covariances and bases (not param-shaped) of every stage: the
    restored pipeline continues bit for bit."""
    def make(params):
        return BasisRotation(params, lr=0.01, betas=(0.9, 0.999), precondition_frequency=2)

    (a, _, _), (b, _, _) = make_pipe(3, "pipedream", 3, make), make_pipe(3, "pipedream", 3, make)
    batches = data(8, 3)
    for x, y in batches[:4]:
        a.step(x, y)
    a.flush()
    engine.save(a, tmp_path / "rot.safetensors")
    engine.load(b, tmp_path / "rot.safetensors")
    for x, y in batches[4:]:
        a.step(x, y)
        b.step(x, y)
    a.flush()
    b.flush()
    for sa, sb in zip(a.stages, b.stages, strict=True):
        assert "Q_L" in sb.optimizer.state[sb.optimizer.param_groups[0]["params"][1]]
        for pa, pb in zip(sa.module.parameters(), sb.module.parameters(), strict=True):
            assert torch.equal(pa, pb)


def test_cli_builds_it_and_refuses_the_delay_mitigations():
    from engine.cli.loop import build_pipeline

    cfg = TrainConfig(schedule="pipedream", stages=2, layers=4, width=8, chunks=2,
                      optimizer="basis-rotation", momentum=0.9, ref_batch=None)
    check_config(cfg)
    pipe, _, _ = build_pipeline(cfg, num_features=8, num_classes=3, updates_per_epoch=2)
    opt = pipe.stages[0].optimizer
    assert isinstance(opt, engine.optim.BasisRotation) and opt.param_groups[0]["betas"] == (0.9, 0.999)
    for kw, flag in (({"spike_compensation": True}, "--spike-compensation"),
                     ({"schedule": "pb", "prediction": "lwp"}, "--prediction"),
                     ({"schedule": "pb", "discrepancy_correction": True}, "--discrepancy-correction"),
                     ({"pipemare_lr": True}, "--pipemare-lr")):
        with pytest.raises(CLIError, match=f"{flag} does not apply to --optimizer basis-rotation"):
            check_config(TrainConfig(**{"optimizer": "basis-rotation", **kw}))
