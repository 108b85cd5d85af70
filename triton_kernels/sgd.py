"""Fused momentum-SGD step: one pass over a flat buffer (or one tensor) per call.

Why a kernel: torch's single-tensor SGD with weight decay, momentum and the delay mitigations
reads and writes the weights, gradient and buffers several times (one pass per torch op);
this kernel reads w, g and the momentum buffer once and writes the new weights, the buffer
and, when asked, the predicted weights (LWP / SpecTrain / "momentum" look-ahead) and
PipeMare's discrepancy buffer in the same pass; the delay-compensated gradient (DC) reads the
same one load of that buffer. The math is
``engine.optim.functional.sgd_update`` op for op (same order of roundings, fp32 arithmetic,
bf16/fp16 weights rounded to nearest even once on store); see that function for the rules.

Every feature is a ``tl.constexpr`` flag, so a launch compiles only what it uses. AMP's
``grad_scale`` and ``found_inf`` are read on the device: an overflowed step writes nothing and
never synchronizes with the host.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from engine.optim.functional import spike_coeffs, validate_sgd_args
from engine.optim.functional_dc import check_dc
from engine.triton_kernels._launch import (
    GPU_WARPS,
    block_offsets,
    cast_rne,
    check_launchable,
    default_block,
    grid_for,
    interpreting,
    load_and_decay,
    placeholder,
)

__all__ = ["fused_sgd_update", "sgd_kernel", "launch_sgd"]


@triton.jit
def sgd_kernel(
    param_ptr, grad_ptr, buf_ptr, pred_ptr, delta_ptr, scale_ptr, inf_ptr,
    n, lr, momentum, keep, weight_decay, sc_a, sc_b, pred_coeff, gamma, keep_gamma, dc_coef,
    BLOCK: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr,
    MOMENTUM: tl.constexpr,
    INIT: tl.constexpr,
    NESTEROV: tl.constexpr,
    SC: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    PREDICT: tl.constexpr,
    DELTA: tl.constexpr,
    DC: tl.constexpr,
    SCALE: tl.constexpr,
    CHECK_INF: tl.constexpr,
):
    offs, mask = block_offsets(n, inf_ptr, BLOCK, CHECK_INF)

    # delta is read once: DC's estimate, then updated; SGD's decay is always L2 (coupled)
    w, g, _w_old, d = load_and_decay(param_ptr, grad_ptr, scale_ptr, delta_ptr, offs, mask,
                                     weight_decay, 1.0, dc_coef, SCALE, MAXIMIZE, WEIGHT_DECAY,
                                     False, DELTA, DC)

    if MOMENTUM:
        if INIT:
            v = g
        else:
            v = tl.load(buf_ptr + offs, mask=mask)
            v = v * momentum + keep * g
        tl.store(buf_ptr + offs, v, mask=mask)
        if SC:
            upd = g * sc_b + sc_a * v
        elif NESTEROV:
            upd = g + momentum * v
        else:
            upd = v
        direction = v
    else:
        upd = g
        direction = g

    w_new = cast_rne(w - lr * upd, param_ptr.dtype.element_ty)
    tl.store(param_ptr + offs, w_new, mask=mask)

    if PREDICT or DELTA:
        # derived buffers use the weights as stored, as the reference does
        w_st = w_new.to(tl.float32)
        if PREDICT:
            pred = cast_rne(w_st - pred_coeff * direction, pred_ptr.dtype.element_ty)
            tl.store(pred_ptr + offs, pred, mask=mask)
        if DELTA:
            d = d * gamma + keep_gamma * (w_st - w)
            tl.store(delta_ptr + offs, d, mask=mask)


def launch_sgd(
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
    block: int | None = None,
) -> None:
    """:func:`fused_sgd_update` with an explicit block size (tests use small blocks to run
    several program instances under the interpreter)."""
    if validate:  # the optimizers validate once per layout and pass validate=False
        validate_sgd_args(param, grad, momentum_buffer, momentum=momentum,
                          dampening=dampening, sc_delay=sc_delay, predicted=predicted,
                          delta=delta, grad_scale=grad_scale, found_inf=found_inf)
    check_dc(dc_coeff, delta, param)  # also unvalidated: DC reads the delta pointer
    use_momentum = momentum != 0
    check_launchable({"param": param, "grad": grad,
                      "momentum_buffer": momentum_buffer if use_momentum else None,
                      "predicted": predicted, "delta": delta})
    n = param.numel()
    if n == 0:
        return
    sc = use_momentum and sc_delay > 0
    sc_a, sc_b = spike_coeffs(momentum, sc_delay) if sc else (0.0, 0.0)
    sc_b *= 1 - dampening  # the spike term's (1 - d), as the reference (ALGORITHMS.md)
    block = block or default_block(param, grad, momentum_buffer if use_momentum else None,
                                   delta)
    sgd_kernel[grid_for(n, block)](
        param, grad, placeholder(momentum_buffer if use_momentum else None, param),
        placeholder(predicted, param), placeholder(delta, param),
        placeholder(grad_scale, param), placeholder(found_inf, param),
        n, float(lr), float(momentum), float(1 - dampening), float(weight_decay),
        float(sc_a), float(sc_b), float(predict_coeff), float(delta_gamma),
        float(1 - delta_gamma), float(dc_coeff),
        BLOCK=block,
        WEIGHT_DECAY=weight_decay != 0,
        MOMENTUM=use_momentum,
        # flags that change no code are canonicalised, so that no launch compiles a
        # duplicate variant (e.g. at the second step of momentum-free SGD)
        INIT=use_momentum and bool(init_momentum),
        NESTEROV=use_momentum and not sc and bool(nesterov),
        SC=sc,
        MAXIMIZE=bool(maximize),
        PREDICT=predicted is not None,
        DELTA=delta is not None,
        DC=dc_coeff != 0,
        SCALE=grad_scale is not None,
        CHECK_INF=found_inf is not None,
        num_warps=1 if interpreting() else GPU_WARPS,
    )


def fused_sgd_update(
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
) -> None:
    """Fused equivalent of ``engine.optim.functional.sgd_update`` (same signature and
    semantics); all tensors must be contiguous and on one device."""
    launch_sgd(param, grad, momentum_buffer, lr=lr, momentum=momentum, dampening=dampening,
               weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
               init_momentum=init_momentum, sc_delay=sc_delay, predicted=predicted,
               predict_coeff=predict_coeff, delta=delta, delta_gamma=delta_gamma,
               dc_coeff=dc_coeff, grad_scale=grad_scale, found_inf=found_inf, validate=validate)
