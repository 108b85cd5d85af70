"""Fused Adam / AdamW step: one pass over a flat buffer (or one tensor) per call.

The update itself is a ``@triton.jit`` body (``_adam_body``) that two private kernels call:
``_adam_kernel`` over one tensor, and ``_adam_multi_kernel`` over the segments of a
``SegmentTable`` (many tensors or flat buckets of one param group, one launch; see
triton_kernels/multi.py), so both compute the same bits. Their launcher, ``launch_adam``,
lives in triton_kernels/adaptive.py beside NAdam's, whose kernel shares ``adam_moments`` and
``store_step`` with this one.

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

import triton
import triton.language as tl

from engine.triton_kernels._launch import block_offsets, cast_rne, load_and_decay, load_lr
from engine.triton_kernels.multi import segment_offsets, segment_ptr

__all__ = ["adam_moments", "store_step", "ADAM_ROLES", "ADAM_DTYPES"]


@triton.jit
def _adam_body(
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
        vmax = tl.load(vmax_ptr + offs, mask=mask).to(tl.float32)
        vmax = tl.maximum(vmax, v, propagate_nan=tl.PropagateNan.ALL)
        tl.store(vmax_ptr + offs, cast_rne(vmax, vmax_ptr.dtype.element_ty), mask=mask)
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
def _adam_kernel(
    param_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, last_ptr, pred_ptr, delta_ptr,
    scale_ptr, inf_ptr, step_ptr, lr_ptr, aux_ptr,
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
    LR_PTR: tl.constexpr,
):
    offs, mask = block_offsets(n, inf_ptr, BLOCK, CHECK_INF)
    lr, decay = load_lr(lr, decay, lr_ptr, aux_ptr, LR_PTR, DECOUPLED)
    _adam_body(param_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, last_ptr, pred_ptr, delta_ptr,
              scale_ptr, step_ptr, offs, mask, lr, w1, beta2, keep2, eps, weight_decay, decay,
              log_beta1, log_beta2, host_step_size, host_bc2_sqrt, host_sc_coef, sc_keep, sc_a,
              horizon, gamma, keep_gamma, dc_coef, WEIGHT_DECAY, DECOUPLED, AMSGRAD, MAXIMIZE,
              SC, LAST, PREDICT, DELTA, DC, SCALE, DEVICE_STEP, LERP_SMALL)


#: operand rows of the multi-tensor table (triton_kernels/multi.py), in order; ``step`` is a
#: one-element row (each tensor's own count, or a flat bucket's shared one)
ADAM_ROLES = ("param", "grad", "m", "v", "vmax", "last", "pred", "delta", "step")
ADAM_DTYPES = {"param": "PARAM_T", "grad": "GRAD_T", "m": "M_T", "v": "V_T", "vmax": "VMAX_T",
                "last": "LAST_T", "pred": "PRED_T", "delta": "DELTA_T", "step": "STEP_T"}


@triton.jit
def _adam_multi_kernel(
    meta_ptr, chunk_ptr, nseg, scale_ptr, inf_ptr, lr_ptr, aux_ptr,
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
    LR_PTR: tl.constexpr,
):
    seg, offs, mask = segment_offsets(meta_ptr, chunk_ptr, nseg, inf_ptr, 9, BLOCK, ALIGNED,
                                      CHECK_INF)
    lr, decay = load_lr(lr, decay, lr_ptr, aux_ptr, LR_PTR, DECOUPLED)
    _adam_body(segment_ptr(meta_ptr, nseg, seg, 0, PARAM_T, ALIGNED),
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
    # fp32 math also for bf16/fp16 moments (state_dtype): loaded up, rounded once on store
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    # torch's lerp: self + wt * (end - self) for |wt| < 0.5, else end - (end - self) * (1 - wt)
    if LERP_SMALL:
        m = m + w1 * (g - m)
    else:
        m = g - (g - m) * (1.0 - w1)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    v = v * beta2 + (keep2 * g) * g
    tl.store(m_ptr + offs, cast_rne(m, m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, cast_rne(v, v_ptr.dtype.element_ty), mask=mask)
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
