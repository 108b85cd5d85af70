"""The CuPy peer of bench/optim.py (bench/cupy_peer.py), verified where no GPU exists.

The kernel's per-element statements are one tuple of strings: the CUDA body is generated
from them and :func:`cupy_peer.evaluate` runs the very same strings on CPU tensors. Checking
``evaluate`` against ``engine.optim.functional.sgd_update`` therefore checks the kernel's
math; the GPU test (cupy + CUDA only) checks the compiled kernel against ``evaluate``.
"""

from __future__ import annotations

import re

import pytest
import torch
from bench_support import load_bench

from engine.optim.functional import prediction_coeff, sgd_update, spike_coeffs

cupy_peer = load_bench("cupy_peer")

SETTINGS = [
    # (momentum, dampening, weight_decay, delay, horizon)
    (0.9, 0.0, 0.0, 4, 4.0),  # the benchmark's case
    (0.9, 0.0, 0.0, 0, 0.0),  # D = 0: plain momentum, prediction off (c = 0)
    (0.9, 0.0, 1e-2, 1, 1.0),  # D = 1 (Nesterov's update) with weight decay
    (0.99, 0.1, 1e-2, 7, 3.5),  # dampening scales the spike term too; a fractional horizon
    (1.0, 0.0, 0.0, 3, 2.0),  # m = 1: b = D
]


@pytest.mark.parametrize("momentum,dampening,weight_decay,delay,horizon", SETTINGS)
def test_kernel_formula_is_functional_sgd_update(momentum, dampening, weight_decay, delay, horizon) -> None:
    lr = 1e-2
    gen = torch.Generator().manual_seed(delay)
    w0 = torch.randn(2048, generator=gen)
    grads = [torch.randn(2048, generator=gen) for _ in range(4)]
    coeffs = cupy_peer.coefficients(lr=lr, momentum=momentum, dampening=dampening,
                                    weight_decay=weight_decay, delay=delay, horizon=horizon)
    w, v = w0.clone(), torch.zeros(2048)
    w_ref, v_ref, pred_ref = w0.clone(), torch.zeros(2048), torch.empty(2048)
    for g in grads:
        w, v, pred = cupy_peer.evaluate(w, g, v, coeffs)
        sgd_update(
            w_ref, g, v_ref, lr=lr, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=False, maximize=False, init_momentum=False,
            sc_delay=delay, predicted=pred_ref,
            predict_coeff=prediction_coeff("linear", lr, momentum, horizon),
        )
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v, v_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pred, pred_ref, rtol=1e-6, atol=1e-6)


def test_coefficients_from_their_definitions_match_the_engines() -> None:
    for m, d, _, delay, h in SETTINGS:
        c = cupy_peer.coefficients(lr=0.1, momentum=m, dampening=d, weight_decay=0.0,
                                   delay=delay, horizon=h)
        a, b = spike_coeffs(m, delay)
        assert c["a"] == pytest.approx(a, rel=1e-12)
        assert c["bd"] == pytest.approx(b * (1 - d), rel=1e-12)
        assert c["c"] == pytest.approx(prediction_coeff("linear", 0.1, m, h), rel=1e-12)
        assert c["damp1"] == 1 - d and c["mom"] == m
    with pytest.raises(ValueError, match="delay"):
        cupy_peer.coefficients(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0,
                               delay=1.5, horizon=1.0)


def test_the_formula_also_runs_on_numpy() -> None:
    np = pytest.importorskip("numpy")
    coeffs = cupy_peer.coefficients(lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.0,
                                    delay=4, horizon=4.0)
    w, g, v = (np.random.default_rng(0).standard_normal(64).astype(np.float32) for _ in range(3))
    out = cupy_peer.evaluate(w, g, v, coeffs)
    ref = cupy_peer.evaluate(torch.from_numpy(w), torch.from_numpy(g), torch.from_numpy(v), coeffs)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(torch.from_numpy(np.asarray(a, dtype=np.float32)), b)


def test_kernel_source_is_the_formula_and_names_only_known_variables() -> None:
    src = cupy_peer.kernel_source()
    for target, expr in cupy_peer.SGD_SC_LWP:
        assert f"float {target} = {expr};" in src
    for out, target in cupy_peer.OUTPUTS:
        assert f"{out} = {target};" in src
    known = {"w", "g", "v", "pred", "float", *cupy_peer.SCALARS,
             *(t for t, _ in cupy_peer.SGD_SC_LWP)}
    names = set(re.findall(r"[A-Za-z_]\w*", src))
    assert names <= known, names - known
    # every local is defined before it is read (C and the Python evaluation agree on order)
    defined = {"w", "g", "v", *cupy_peer.SCALARS}
    for target, expr in cupy_peer.SGD_SC_LWP:
        assert set(re.findall(r"[A-Za-z_]\w*", expr)) <= defined, (target, expr)
        defined.add(target)
    # the kernel signature: gradient and scalars in, weights/momentum/prediction in place
    assert cupy_peer._IN_PARAMS.startswith("float32 g, ")
    assert cupy_peer._OUT_PARAMS == "float32 w, float32 v, float32 pred"


def test_status_explains_why_the_peer_is_skipped() -> None:
    ok, why = cupy_peer.status()
    assert isinstance(ok, bool) and why
    if not ok:
        assert "cupy" in why
    optim = load_bench("optim")
    found, skipped = optim.builders("sgd_sc_pred", torch.device("cuda"), torch.float32)
    if ok:
        assert "cupy_elementwise" in found
    else:  # no CUDA is touched to say so
        assert skipped == {"cupy_elementwise": why}
    found, skipped = optim.builders("sgd_sc_pred", torch.device("cuda"), torch.bfloat16)
    assert "cupy_elementwise" not in found and "cupy_elementwise" in skipped


def test_the_engine_never_imports_cupy() -> None:
    import subprocess
    import sys

    code = ("import sys, engine, engine.optim, engine.arena, engine.runtime.pipeline; "
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.cuda
def test_cupy_kernel_matches_the_formula_on_the_gpu() -> None:
    ok, why = cupy_peer.status()
    if not ok:
        pytest.skip(why)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1 << 20, device="cuda", generator=gen)
    g = torch.randn(1 << 20, device="cuda", generator=gen)
    v = torch.randn(1 << 20, device="cuda", generator=gen)
    pred = torch.empty_like(w)
    coeffs = cupy_peer.coefficients(lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=1e-2,
                                    delay=4, horizon=4.0)
    want = cupy_peer.evaluate(w.cpu(), g.cpu(), v.cpu(), coeffs)
    cupy_peer.sgd_sc_lwp_step(w, g, v, pred, coeffs)()
    torch.cuda.synchronize()
    for got, ref in zip((w, v, pred), want, strict=True):
        torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-6)
    ms, n = cupy_peer.profile_gpu_ms(lambda: None, n_repeat=5, n_warmup=1)
    assert ms >= 0 and n == 5
