"""SGD's fused CPU loop: the reference update in one pass over memory (``engine._C``).

Why: without a GPU the reference path (:func:`engine.optim.functional.sgd_update`, plain torch
ops) *is* the optimizer step, and with spike compensation and weight prediction it is six
torch ops, six passes over memory, against three for plain momentum SGD. The C++ loop
(csrc/sgd_cpu.cpp, ``at::parallel_for`` over contiguous chunks) reads g, w, v once and writes
w, v, the prediction and PipeMare's delta once, rounding every operation as torch's CPU
kernels round the reference's ops, so its result is bit-identical to the reference's.

It serves contiguous fp32 CPU tensors without autograd; everything else (bf16/fp16/fp64/
complex params, non-contiguous tensors, a differentiable step, delay compensation's
``dc_coeff``) runs the reference, which
:func:`sgd_update` calls itself, so the two are interchangeable as the ``fn`` of an update.
``engine.optim.SGD`` uses it for CPU steps with spike compensation, prediction or delta;
plain momentum SGD stays on torch's ops (bitwise torch.optim.SGD by construction). Set
``PE_CPU_LOOP=0`` to force the reference path (read at every step).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from engine.optim import functional
from engine.update_rules import check_dc

__all__ = ["ENV", "available", "enabled", "eligible", "sgd_update", "variant"]

#: environment variable: "0" forces the reference path for every SGD step
ENV = "PE_CPU_LOOP"

_MISSING = object()
_step: Any = _MISSING


def _native() -> Any:
    """``engine._C.sgd_step_cpu``, or None when the extension is missing or predates it."""
    global _step
    if _step is _MISSING:
        try:
            from engine import _C
        except ImportError:
            _step = None
        else:
            _step = getattr(_C, "sgd_step_cpu", None)
    return _step


def available() -> bool:
    """True when the compiled extension has the loop (``engine._C`` built from this tree)."""
    return _native() is not None


def enabled() -> bool:
    """True unless ``PE_CPU_LOOP=0`` is set; the loop must also be :func:`available`."""
    return os.environ.get(ENV, "1").strip() != "0" and available()


def variant() -> str:
    """"fma" or "baseline": how the loop rounds its multiply-adds here (it follows torch's CPU
    capability, so that it rounds as torch's own kernels do)."""
    from engine import _C

    return str(_C.sgd_cpu_variant())


def eligible(param: Tensor, grad: Tensor, *others: Tensor | None) -> bool:
    """Whether the loop can run this update: fp32 contiguous CPU tensors, no autograd."""
    tensors = [param, grad, *(t for t in others if t is not None)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False  # a differentiable step: autograd must see the torch ops
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors
    )


def sgd_update(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | None,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    init_momentum: bool,
    sc_delay: int = 0,
    predicted: Tensor | None = None,
    predict_coeff: float = 0.0,
    delta: Tensor | None = None,
    delta_gamma: float = 0.0,
    dc_coeff: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    validate: bool = True,
) -> bool:
    """:func:`engine.optim.functional.sgd_update` (same arguments, same result bit for bit),
    through the fused loop where :func:`eligible`; returns True when the loop ran, False
    when the reference did."""
    if validate:
        functional.validate_sgd_args(param, grad, momentum_buffer, momentum=momentum,
                                     dampening=dampening, sc_delay=sc_delay, predicted=predicted,
                                     delta=delta, grad_scale=grad_scale, found_inf=found_inf)
        check_dc(dc_coeff, delta, param)
    buf = momentum_buffer if momentum != 0 else None
    native = _native()
    # delay compensation (dc_coeff) is not in the loop: the reference computes it
    if native is None or dc_coeff != 0 or not eligible(param, grad, buf, predicted, delta, grad_scale):
        functional.sgd_update(param, grad, momentum_buffer, lr=lr, momentum=momentum,
                              dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                              maximize=maximize, init_momentum=init_momentum, sc_delay=sc_delay,
                              predicted=predicted, predict_coeff=predict_coeff, delta=delta,
                              delta_gamma=delta_gamma, dc_coeff=dc_coeff, grad_scale=grad_scale,
                              found_inf=found_inf, validate=False)
        return False
    if found_inf is not None and bool(found_inf.item() != 0):
        return True  # the whole update is skipped, as the reference does (same host read)
    spike = momentum != 0 and sc_delay > 0
    a, b = functional.spike_coeffs(momentum, sc_delay) if spike else (1.0, 0.0)
    scale = None if grad_scale is None else float(grad_scale.float())
    native(param, grad, buf, predicted, delta, lr=lr, momentum=momentum, dampening=dampening,
           weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
           init_momentum=init_momentum, spike=spike, sc_a=a, sc_bd=b * (1 - dampening),
           predict_coeff=predict_coeff, delta_gamma=delta_gamma, grad_scale=scale)
    return True
