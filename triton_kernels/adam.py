"""Fused Adam / AdamW step: one pass over a flat buffer (or one tensor) per call.

The update itself is a ``@triton.jit`` body (``adam_body``) that two kernels call:
``adam_kernel`` over one tensor, and ``adam_multi_kernel`` over the segments of a
``SegmentTable`` (many tensors or flat buckets of one param group, one launch; see
triton_kernels/multi.py), so both compute the same bits.

Reads w, g, exp_avg, exp_avg_sq (and max_exp_avg_sq for AMSGrad) once and writes the new
weights and moments, plus, when asked, the applied update (``last_update``), the predicted
weights and PipeMare's ``delta`` in the same pass (the delay-compensated gradient reads that
same one load of ``delta``). The math is
``engine.optim.functional.adam_update`` op for op, including the project's own delay
compensation for Adam (see that docstring): fp32 arithmetic, torch's lerp formula for the
first moment, IEEE-rounded sqrt and division (``sqrt_rn``/``div_rn``; plain ``/`` and
``sqrt`` are approximate on GPUs), bf16/fp16 weights rounded to nearest even once on store.

The step counter and AMP (why it is done this way):

* ``step`` is a one-element fp32 tensor incremented by this call unless ``found_inf`` is set.
  The increment is a tiny device op issued *before* the kernel (``step += (found_inf == 0)``)
  rather than a write inside the kernel: every program instance reads ``step`` to form the
  bias corrections, and a write by one program would race with the reads of the others.
* When ``step`` lives on the param's device (the CUDA-graph friendly layout, and always under
  the interpreter), the kernel computes the bias corrections itself in fp64 from
  ``log(beta)`` (so no host synchronization). When ``step`` is a CPU tensor and the params
  are on the GPU (torch's default layout), the host computes them from ``step`` exactly as
  torch does; with a ``found_inf`` tensor that costs one host read of ``found_inf``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.optim.functional import validate_adam_args
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
from engine.triton_kernels.multi import (
    SegmentTable,
    check_roles,
    launch_segments,
    segment_offsets,
    segment_ptr,
)

__all__ = ["fused_adam_update", "fused_adam_multi", "adam_kernel", "adam_multi_kernel",
           "launch_adam", "adam_moments", "store_step", "ADAM_ROLES"]


@triton.jit
def adam_body(
    param_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, last_ptr, pred_ptr, delta_ptr, scale_ptr,
    step_ptr, offs, mask,
    lr, w1, beta2, keep2, eps, weight_decay, decay, log_beta1, log_beta2,
    host_step_size, host_bc2_sqrt, host_sc_coef, sc_keep, sc_a, horizon, gamma, keep_gamma,
    dc_coef,
    WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr, AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr, SC: tl.constexpr, LAST: tl.constexpr, PREDICT: tl.constexpr,
    DELTA: tl.constexpr, DC: tl.constexpr, SCALE: tl.constexpr, DEVICE_STEP: tl.constexpr,
    LERP_SMALL: tl.constexpr,
):
    """The update of the elements ``offs`` (masked): what both the single-tensor and the
    multi-tensor kernel run."""
    if DEVICE_STEP:
        # bias corrections from the (already incremented) step, in fp64: 1 - beta2**t
        # cancels badly in fp32 for small t
        t = tl.load(step_ptr).to(tl.float64)
        bc1 = 1.0 - tl.exp(t * log_beta1)
        bc2 = 1.0 - tl.exp(t * log_beta2)
        step_size = (lr / bc1).to(tl.float32)
        bc2_sqrt = tl.sqrt(bc2).to(tl.float32)
        sc_coef = (sc_a / bc1).to(tl.float32)
    else:
        step_size = host_step_size
        bc2_sqrt = host_bc2_sqrt
        sc_coef = host_sc_coef

    w, g, w_old, d = load_and_decay(param_ptr, grad_ptr, scale_ptr, delta_ptr, offs, mask,
                                    weight_decay, decay, dc_coef, SCALE, MAXIMIZE, WEIGHT_DECAY,
                                    DECOUPLED, DELTA, DC)

    m, v = adam_moments(m_ptr, v_ptr, offs, mask, g, w1, beta2, keep2, LERP_SMALL)
    if AMSGRAD:
        vmax = tl.load(vmax_ptr + offs, mask=mask)
        vmax = tl.maximum(vmax, v, propagate_nan=tl.PropagateNan.ALL)
        tl.store(vmax_ptr + offs, vmax, mask=mask)
        v = vmax

    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    if SC:
        numer = m * sc_coef + sc_keep * g
        w = w + tl.div_rn(-lr * numer, denom)
    else:
        w = w + tl.div_rn(-step_size * m, denom)

    store_step(param_ptr, last_ptr, pred_ptr, delta_ptr, offs, mask, w, w_old, d, horizon,
               gamma, keep_gamma, LAST, PREDICT, DELTA)


@triton.jit
def adam_kernel(
    param_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, last_ptr, pred_ptr, delta_ptr,
    scale_ptr, inf_ptr, step_ptr,
    n, lr, w1, beta2, keep2, eps, weight_decay, decay, log_beta1, log_beta2,
    host_step_size, host_bc2_sqrt, host_sc_coef, sc_keep, sc_a, horizon, gamma, keep_gamma,
    dc_coef,
    BLOCK: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr,
    DECOUPLED: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    SC: tl.constexpr,
    LAST: tl.constexpr,
    PREDICT: tl.constexpr,
    DELTA: tl.constexpr,
    DC: tl.constexpr,
    SCALE: tl.constexpr,
    CHECK_INF: tl.constexpr,
    DEVICE_STEP: tl.constexpr,
    LERP_SMALL: tl.constexpr,
):
    offs, mask = block_offsets(n, inf_ptr, BLOCK, CHECK_INF)
    adam_body(param_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, last_ptr, pred_ptr, delta_ptr,
              scale_ptr, step_ptr, offs, mask, lr, w1, beta2, keep2, eps, weight_decay, decay,
              log_beta1, log_beta2, host_step_size, host_bc2_sqrt, host_sc_coef, sc_keep, sc_a,
              horizon, gamma, keep_gamma, dc_coef, WEIGHT_DECAY, DECOUPLED, AMSGRAD, MAXIMIZE,
              SC, LAST, PREDICT, DELTA, DC, SCALE, DEVICE_STEP, LERP_SMALL)


#: operand rows of the multi-tensor table (triton_kernels/multi.py), in order; ``step`` is a
#: one-element row (each tensor's own count, or a flat bucket's shared one)
ADAM_ROLES = ("param", "grad", "m", "v", "vmax", "last", "pred", "delta", "step")
_ADAM_DTYPES = {"param": "PARAM_T", "grad": "GRAD_T", "m": "M_T", "v": "V_T", "vmax": "VMAX_T",
                "last": "LAST_T", "pred": "PRED_T", "delta": "DELTA_T", "step": "STEP_T"}


@triton.jit
def adam_multi_kernel(
    meta_ptr, chunk_ptr, nseg, scale_ptr, inf_ptr,
    lr, w1, beta2, keep2, eps, weight_decay, decay, log_beta1, log_beta2,
    host_step_size, host_bc2_sqrt, host_sc_coef, sc_keep, sc_a, horizon, gamma, keep_gamma,
    dc_coef,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    PARAM_T: tl.constexpr, GRAD_T: tl.constexpr, M_T: tl.constexpr, V_T: tl.constexpr,
    VMAX_T: tl.constexpr, LAST_T: tl.constexpr, PRED_T: tl.constexpr, DELTA_T: tl.constexpr,
    STEP_T: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr,
    DECOUPLED: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    SC: tl.constexpr,
    LAST: tl.constexpr,
    PREDICT: tl.constexpr,
    DELTA: tl.constexpr,
    DC: tl.constexpr,
    SCALE: tl.constexpr,
    CHECK_INF: tl.constexpr,
    DEVICE_STEP: tl.constexpr,
    LERP_SMALL: tl.constexpr,
):
    seg, offs, mask = segment_offsets(meta_ptr, chunk_ptr, nseg, inf_ptr, 9, BLOCK, ALIGNED,
                                      CHECK_INF)
    adam_body(segment_ptr(meta_ptr, nseg, seg, 0, PARAM_T, ALIGNED),
              segment_ptr(meta_ptr, nseg, seg, 1, GRAD_T, ALIGNED),
              segment_ptr(meta_ptr, nseg, seg, 2, M_T, ALIGNED),
              segment_ptr(meta_ptr, nseg, seg, 3, V_T, ALIGNED),
              segment_ptr(meta_ptr, nseg, seg, 4, VMAX_T, ALIGNED),
              segment_ptr(meta_ptr, nseg, seg, 5, LAST_T, ALIGNED),
              segment_ptr(meta_ptr, nseg, seg, 6, PRED_T, ALIGNED),
              segment_ptr(meta_ptr, nseg, seg, 7, DELTA_T, ALIGNED),
              scale_ptr, segment_ptr(meta_ptr, nseg, seg, 8, STEP_T, False), offs, mask,
              lr, w1, beta2, keep2, eps, weight_decay, decay, log_beta1, log_beta2,
              host_step_size, host_bc2_sqrt, host_sc_coef, sc_keep, sc_a, horizon, gamma,
              keep_gamma, dc_coef, WEIGHT_DECAY, DECOUPLED, AMSGRAD, MAXIMIZE, SC, LAST, PREDICT,
              DELTA, DC, SCALE, DEVICE_STEP, LERP_SMALL)


@triton.jit
def adam_moments(m_ptr, v_ptr, offs, mask, g, w1, beta2, keep2, LERP_SMALL: tl.constexpr):
    """Adam's moments updated and stored (shared with NAdam's kernel): torch's lerp for the
    first, ``v * b2 + (1 - b2) * g * g`` for the second; returns the new (m, v)."""
    m = tl.load(m_ptr + offs, mask=mask)
    # torch's lerp: self + wt * (end - self) for |wt| < 0.5, else end - (end - self) * (1 - wt)
    if LERP_SMALL:
        m = m + w1 * (g - m)
    else:
        m = g - (g - m) * (1.0 - w1)
    v = tl.load(v_ptr + offs, mask=mask)
    v = v * beta2 + (keep2 * g) * g
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    return m, v


@triton.jit
def store_step(param_ptr, last_ptr, pred_ptr, delta_ptr, offs, mask, w, w_old, d, horizon,
               gamma, keep_gamma, LAST: tl.constexpr, PREDICT: tl.constexpr,
               DELTA: tl.constexpr):
    """Store the new weights (rounded once) and the buffers derived from the applied step
    (shared with NAdam's kernel): last_update, the prediction, PipeMare's delta (``d``: its
    value before the step, as :func:`load_and_decay` loaded it)."""
    w_new = cast_rne(w, param_ptr.dtype.element_ty)
    tl.store(param_ptr + offs, w_new, mask=mask)
    if LAST or PREDICT or DELTA:
        # derived buffers use the weights as stored, as the reference does
        w_st = w_new.to(tl.float32)
        applied = w_old - w_st
        if LAST:
            tl.store(last_ptr + offs, applied, mask=mask)
        if PREDICT:
            pred = cast_rne(w_st - horizon * applied, pred_ptr.dtype.element_ty)
            tl.store(pred_ptr + offs, pred, mask=mask)
        if DELTA:
            d = d * gamma + keep_gamma * (w_st - w_old)
            tl.store(delta_ptr + offs, d, mask=mask)


def _log(beta: float) -> float:
    # beta = 0 is legal (no averaging): log -> -inf makes beta**t = exp(-inf) = 0 in-kernel
    return math.log(beta) if beta > 0 else -math.inf


def _advance_steps(steps: list[Tensor], found_inf: Tensor | None) -> None:
    """Add 1 to each step count, or, with AMP's ``found_inf``, add (found_inf == 0): on the
    device when found_inf is there (no host synchronization). One foreach op for all."""
    if found_inf is None:
        torch._foreach_add_(steps, 1)
    elif found_inf.device == steps[0].device:
        # a list of tensors, never one 0-dim tensor: Python's overload resolution turns a lone
        # 0-dim tensor into a Scalar (an .item(), a host sync that invalidated CUDA graph
        # captures of skip_update steps on the H100, issue 22); the list overload reads it on
        # the device
        inc = (found_inf.reshape(()) == 0).to(steps[0].dtype)
        torch._foreach_add_(steps, [inc] * len(steps))
    elif found_inf.item() == 0:
        torch._foreach_add_(steps, 1)


def launch_adam(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    *,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    sc_delay: int = 0,
    last_update: Tensor | None = None,
    predicted: Tensor | None = None,
    predict_horizon: float = 0.0,
    delta: Tensor | None = None,
    delta_gamma: float = 0.0,
    dc_coeff: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    validate: bool = True,
    block: int | None = None,
    device_step: bool | None = None,
) -> None:
    """:func:`fused_adam_update` with an explicit block size and bias-correction mode.

    ``device_step=None`` picks the device path when ``step`` is on the param's device;
    tests force ``False`` to cover the host path on CPU.
    """
    if validate:  # the optimizers validate once per layout and pass validate=False
        validate_adam_args(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step,
                           amsgrad=amsgrad, sc_delay=sc_delay, last_update=last_update,
                           predicted=predicted, delta=delta, grad_scale=grad_scale,
                           found_inf=found_inf)
    check_dc(dc_coeff, delta, param)  # also unvalidated: DC reads the delta pointer
    if step.device != param.device and step.device.type != "cpu":
        raise ValueError(f"step is on {step.device}; it must be on the CPU or on the param's "
                         f"device {param.device}")
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Adam needs 0 <= beta < 1, got beta1={beta1!r}, beta2={beta2!r}")
    check_launchable({"param": param, "grad": grad, "exp_avg": exp_avg,
                      "exp_avg_sq": exp_avg_sq,
                      "max_exp_avg_sq": max_exp_avg_sq if amsgrad else None,
                      "last_update": last_update, "predicted": predicted, "delta": delta})
    if device_step is None:
        device_step = step.device == param.device
    elif device_step and step.device != param.device:
        raise ValueError("device_step=True needs step on the param's device")

    _advance_steps([step], found_inf)

    sc_a = beta1 ** int(sc_delay) if sc_delay > 0 else 0.0
    if device_step:
        host = (0.0, 0.0, 0.0)
    else:
        # torch's non-capturable path: Python floats from the step value
        t = step.item()
        bias_correction1 = 1 - beta1**t
        host = (lr / bias_correction1, (1 - beta2**t) ** 0.5, sc_a / bias_correction1)

    n = param.numel()
    if n == 0:
        return
    scalars, flags = _adam_args(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        decoupled=decoupled, amsgrad=amsgrad, maximize=maximize, sc_delay=sc_delay, host=host,
        predict_horizon=predict_horizon, delta_gamma=delta_gamma, dc_coeff=dc_coeff,
        last=last_update is not None, predict=predicted is not None, delta=delta is not None,
        scale=grad_scale is not None, check_inf=found_inf is not None, device_step=device_step)
    block = block or default_block(param, grad, exp_avg)  # the other state is exp_avg's dtype
    adam_kernel[grid_for(n, block)](
        param, grad, exp_avg, exp_avg_sq,
        placeholder(max_exp_avg_sq if amsgrad else None, param),
        placeholder(last_update, param), placeholder(predicted, param),
        placeholder(delta, param), placeholder(grad_scale, param),
        placeholder(found_inf, param), step if device_step else param,
        n, *scalars, BLOCK=block, **flags)


@functools.lru_cache(maxsize=256)  # a pure function of numbers: steady steps reuse it
def _adam_args(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               decoupled: bool, amsgrad: bool, maximize: bool, sc_delay: int,
               host: tuple[float, float, float], predict_horizon: float, delta_gamma: float,
               dc_coeff: float, last: bool, predict: bool, delta: bool, scale: bool,
               check_inf: bool, device_step: bool) -> tuple[tuple[float, ...], dict]:
    """The kernels' float arguments and constexpr flags (shared by both launchers);
    ``host``: the host-computed step size, sqrt(bc2) and SC coefficient (unused with
    ``device_step``)."""
    sc_a = beta1 ** int(sc_delay) if sc_delay > 0 else 0.0
    scalars = (float(lr), float(1 - beta1), float(beta2), float(1 - beta2), float(eps),
               float(weight_decay), float(1 - lr * weight_decay), _log(beta1), _log(beta2),
               *map(float, host), float(1 - sc_a), float(sc_a), float(predict_horizon),
               float(delta_gamma), float(1 - delta_gamma), float(dc_coeff))
    flags = dict(
        WEIGHT_DECAY=weight_decay != 0,
        DECOUPLED=weight_decay != 0 and bool(decoupled),  # no duplicate variant without decay
        AMSGRAD=bool(amsgrad),
        MAXIMIZE=bool(maximize),
        SC=sc_delay > 0,
        LAST=last,
        PREDICT=predict,
        DELTA=delta,
        DC=dc_coeff != 0,
        SCALE=scale,
        CHECK_INF=check_inf,
        DEVICE_STEP=bool(device_step),
        LERP_SMALL=abs(1 - beta1) < 0.5,
        num_warps=1 if interpreting() else GPU_WARPS,
    )
    return scalars, flags


def fused_adam_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    *,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    sc_delay: int = 0,
    last_update: Tensor | None = None,
    predicted: Tensor | None = None,
    predict_horizon: float = 0.0,
    delta: Tensor | None = None,
    delta_gamma: float = 0.0,
    dc_coeff: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    validate: bool = True,
) -> None:
    """Fused equivalent of ``engine.optim.functional.adam_update`` (same signature and
    semantics); all tensors must be contiguous and on one device (``step`` may be a CPU
    tensor when the params are on the GPU)."""
    launch_adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step=step, lr=lr,
                beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                decoupled=decoupled, amsgrad=amsgrad, maximize=maximize, sc_delay=sc_delay,
                last_update=last_update, predicted=predicted,
                predict_horizon=predict_horizon, delta=delta, delta_gamma=delta_gamma,
                dc_coeff=dc_coeff, grad_scale=grad_scale, found_inf=found_inf, validate=validate)



def fused_adam_multi(
    table: SegmentTable,
    grads: object = None,
    exp_avgs: object = None,
    exp_avg_sqs: object = None,
    max_exp_avg_sqs: object = None,
    *,
    step: object = None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    sc_delay: int = 0,
    last_update: object = None,
    predicted: object = None,
    predict_horizon: float = 0.0,
    delta: object = None,
    delta_gamma: float = 0.0,
    dc_coeff: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    validate: bool = True,
) -> None:
    """:func:`fused_adam_update` over every segment of ``table`` (roles :data:`ADAM_ROLES`) in
    one launch, after one foreach op that advances the table's distinct step counts (each on
    its param's device: the bias corrections are formed in the kernel). The tensor arguments
    only say which operands the caller means and must agree with the table."""
    check_roles(table, {"grad": True, "m": True, "v": True, "vmax": bool(amsgrad),
                        "last": last_update is not None, "pred": predicted is not None,
                        "delta": delta is not None, "step": True})
    if validate:
        for p, g, m, v, vmax, last, pred, d, st in table.segments(ADAM_ROLES):
            validate_adam_args(p, g, m, v, vmax, st, amsgrad=amsgrad, sc_delay=sc_delay,
                               last_update=last, predicted=pred, delta=d,
                               grad_scale=grad_scale, found_inf=found_inf)
    param = table.tensors("param")[0]
    check_dc(dc_coeff, table.first("delta"), param)
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Adam needs 0 <= beta < 1, got beta1={beta1!r}, beta2={beta2!r}")
    steps = table.unique("step")
    if steps[0].device != table.device:
        raise ValueError(f"the multi-tensor launch needs the step counts on {table.device} "
                         f"(got {steps[0].device}); use fused_adam_update for CPU steps")
    _advance_steps(steps, found_inf)
    scalars, flags = _adam_args(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        decoupled=decoupled, amsgrad=amsgrad, maximize=maximize, sc_delay=sc_delay,
        host=(0.0, 0.0, 0.0), predict_horizon=predict_horizon, delta_gamma=delta_gamma,
        dc_coeff=dc_coeff, last=table.has("last"), predict=table.has("pred"),
        delta=table.has("delta"), scale=grad_scale is not None,
        check_inf=found_inf is not None, device_step=True)
    launch_segments(adam_multi_kernel, table, _ADAM_DTYPES, scalars, flags, grad_scale, found_inf)
