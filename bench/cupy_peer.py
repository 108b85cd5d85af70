"""A second, independent implementation of the fused SGD + spike compensation + LWP update,
as a CuPy ``ElementwiseKernel``, and CuPy's own timer as a cross-check of the Triton kernels.

Why it exists: bench/optim.py compares the engine's Triton kernel with torch's optimizers,
which do not compute spike compensation or weight prediction; the plain-torch composition
does, but in several passes. This kernel does the same math in ONE pass, written by hand in
CUDA C and compiled by NVRTC through CuPy, sharing no code with triton_kernels: if it runs
at the same speed as the Triton kernel, both are at what the hardware allows; if it is much
faster, the Triton kernel leaves bandwidth on the table.

The per-element formula is written ONCE, below, as a few assignments in the common subset of
C and Python expressions (names, ``+ - *``, parentheses). :func:`kernel_source` turns them into
the kernel body; :func:`evaluate` runs the same statements on torch/numpy arrays, so the
kernel's math is checked against ``engine.optim.functional.sgd_update`` on CPU
(tests/bench/test_bench_cupy.py) where no GPU exists. The coefficients are computed here, from
their definitions (not by the engine's helpers)::

    a  = m^D                              (spike compensation, Kosson et al.)
    bd = (1 - m^D) / (1 - m) * (1 - d)    (b = D when m = 1; times (1 - dampening))
    c  = lr * H                           (linear weight prediction, H = horizon)

    g' = g + wd * w
    v  = m * v + (1 - d) * g'
    w  = w - lr * (bd * g' + a * v)
    w_hat = w - c * v

(the first-step special case of torch's momentum, v = g', is the same as v = m*0 + g' when
d = 0, which is what the benchmark runs; nesterov and maximize are not part of this kernel.)

CuPy is optional and never imported by the engine: everything here imports it lazily, and
:func:`status` says why it cannot be used (not installed, or ``cupy.cuda.is_available()``
False), which the benchmark prints before skipping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "SGD_SC_LWP",
    "OUTPUTS",
    "SCALARS",
    "coefficients",
    "kernel_source",
    "evaluate",
    "status",
    "build_kernel",
    "sgd_sc_lwp_step",
    "profile_gpu_ms",
]

#: SGD + SC + LWP for one element: (target, expression) in order; ``w``, ``g``, ``v`` are the
#: element's weight, gradient and momentum before the step, the other names are SCALARS.
SGD_SC_LWP: tuple[tuple[str, str], ...] = (
    ("gp", "g + wd * w"),
    ("v_new", "mom * v + damp1 * gp"),
    ("w_new", "w - lr * (bd * gp + a * v_new)"),
    ("p_new", "w_new - c * v_new"),
)
#: (output array, statement target it receives)
OUTPUTS: tuple[tuple[str, str], ...] = (("w", "w_new"), ("v", "v_new"), ("pred", "p_new"))
#: scalar kernel arguments (float32), in call order after the gradient
SCALARS: tuple[str, ...] = ("lr", "mom", "damp1", "wd", "a", "bd", "c")

_IN_PARAMS = "float32 g, " + ", ".join(f"float32 {name}" for name in SCALARS)
_OUT_PARAMS = ", ".join(f"float32 {name}" for name, _ in OUTPUTS)


def coefficients(
    *, lr: float, momentum: float, dampening: float, weight_decay: float, delay: int, horizon: float
) -> dict[str, float]:
    """The kernel's scalar arguments for one step (see the module docstring)."""
    if int(delay) != delay or delay < 0:
        raise ValueError(f"delay must be an integer >= 0, got {delay!r}")
    a = momentum**delay
    b = float(delay) if momentum == 1.0 else (1.0 - a) / (1.0 - momentum)
    return {
        "lr": lr,
        "mom": momentum,
        "damp1": 1.0 - dampening,
        "wd": weight_decay,
        "a": a,
        "bd": b * (1.0 - dampening),
        "c": lr * horizon,
    }


def kernel_source() -> str:
    """The ElementwiseKernel body: one ``float`` local per statement, then the outputs."""
    lines = [f"float {target} = {expr};" for target, expr in SGD_SC_LWP]
    lines += [f"{out} = {target};" for out, target in OUTPUTS]
    return "\n".join(lines)


def evaluate(w: Any, g: Any, v: Any, coeffs: Mapping[str, float]) -> tuple[Any, Any, Any]:
    """The kernel's statements on CPU arrays (torch tensors or numpy arrays): returns
    (w_new, v_new, w_hat). The same strings as :func:`kernel_source`, so a test of this
    function is a test of the kernel's math."""
    env: dict[str, Any] = {"w": w, "g": g, "v": v, **{k: coeffs[k] for k in SCALARS}}
    for target, expr in SGD_SC_LWP:
        env[target] = eval(expr, {"__builtins__": {}}, env)  # fixed strings of this module
    return tuple(env[target] for _, target in OUTPUTS)  # type: ignore[return-value]


def status() -> tuple[bool, str]:
    """(usable, reason): cupy imports and ``cupy.cuda.is_available()``."""
    try:
        import cupy
    except ImportError as exc:
        return False, f"cupy is not installed ({exc})"
    try:
        available = bool(cupy.cuda.is_available())
    except Exception as exc:  # a broken CUDA install reports here, not at import
        return False, f"cupy.cuda.is_available() raised {type(exc).__name__}: {exc}"
    if not available:
        return False, "cupy.cuda.is_available() is False (no usable CUDA device for CuPy)"
    return True, f"cupy {cupy.__version__}"


_KERNEL: Any = None


def build_kernel() -> Any:
    """The compiled-on-first-call ``cupy.ElementwiseKernel`` (cached)."""
    global _KERNEL
    if _KERNEL is None:
        import cupy

        _KERNEL = cupy.ElementwiseKernel(
            _IN_PARAMS, _OUT_PARAMS, kernel_source(), "engine_bench_sgd_sc_lwp", no_return=True
        )
    return _KERNEL


def sgd_sc_lwp_step(w: Any, g: Any, v: Any, pred: Any, coeffs: Mapping[str, float]) -> Callable[[], None]:
    """A zero-argument step over fp32 CUDA torch tensors (shared with CuPy through DLPack,
    no copy): updates ``w`` and ``v`` in place and writes ``pred``."""
    import cupy

    for name, t in (("w", w), ("g", g), ("v", v), ("pred", pred)):
        if t.dtype != torch.float32 or t.device.type != "cuda" or not t.is_contiguous():
            raise ValueError(f"the CuPy peer takes contiguous fp32 CUDA tensors; {name} is "
                             f"{t.dtype} on {t.device}")
    arrays = [cupy.from_dlpack(t.detach()) for t in (g, w, v, pred)]
    ga, wa, va, pa = arrays
    scalars = [float(coeffs[k]) for k in SCALARS]
    kernel = build_kernel()

    def step() -> None:
        kernel(ga, *scalars, wa, va, pa)

    step.arrays = arrays  # type: ignore[attr-defined]  # keep the DLPack views alive
    return step


def profile_gpu_ms(fn: Callable[[], object], *, n_repeat: int = 50, n_warmup: int = 5,
                   max_duration: float = 1.0) -> tuple[float, int]:
    """Median GPU time of ``fn`` in ms by ``cupyx.profiler.benchmark`` (CUDA events around
    every call on CuPy's current stream, which is the legacy default stream that torch and
    Triton launch on unless a stream is set; no L2 flush between calls), and the number of
    timed calls."""
    import numpy as np
    from cupyx.profiler import benchmark

    res = benchmark(fn, n_repeat=n_repeat, n_warmup=n_warmup, max_duration=max_duration)
    times = np.asarray(res.gpu_times)[0]
    return float(np.median(times) * 1e3), int(times.size)
