"""Fused NAdam / NAdamW step: one pass over a flat buffer (or one tensor) per call.

The update itself is a ``@triton.jit`` body (``_nadam_body``) that two private kernels call:
``_nadam_kernel`` over one tensor, and ``_nadam_multi_kernel`` over the segments of a
``SegmentTable`` (many tensors or flat buckets of one param group, one launch; see
triton_kernels/multi.py), so both compute the same bits. Their launcher, ``launch_nadam``,
lives in triton_kernels/adaptive.py beside Adam's.

Reads w, g, exp_avg, exp_avg_sq once and writes the new weights and moments, plus, when
asked, the applied update (``last_update``), the predicted weights and PipeMare's ``delta``
in the same pass. The math is ``engine.optim.functional_nadam.nadam_update``: fp32
arithmetic, torch's lerp for the first moment, IEEE-rounded sqrt and division, bf16/fp16
weights rounded to nearest even once on store.

The scalars (why it is done this way): NAdam's coefficients need mu_t, mu_{t+1} and the
running product prod mu_1..mu_t. The product is sequential state, so the launcher advances
``step`` and ``mu_product`` with tiny device ops before the kernel (a write inside the kernel
would race with the other programs' reads), and skips both under an AMP overflow without a
host read. When ``step`` and ``mu_product`` live on the param's device (the engine
optimizers' layout) the kernel forms mu_t, mu_{t+1}, the two coefficients and the bias
correction in fp64 from them: no host synchronization. Otherwise (torch's CPU layout of a
non-capturable NAdam) the host computes them from the step exactly as torch does, one host
read per call.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.triton_kernels._launch import block_offsets, load_and_decay, load_lr
from engine.triton_kernels.adam import adam_moments, store_step
from engine.triton_kernels.multi import segment_offsets, segment_ptr

__all__ = ["NADAM_ROLES", "NADAM_DTYPES"]


@triton.jit
def _nadam_body(
    param_ptr, grad_ptr, m_ptr, v_ptr, last_ptr, pred_ptr, delta_ptr, scale_ptr, step_ptr,
    prod_ptr, offs, mask,
    lr, beta1, psi_log96, log_beta2, w1, beta2, keep2, eps, weight_decay, decay,
    host_bc2, host_coef_g, host_coef_m, horizon, gamma, keep_gamma, dc_coef,
    WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
    LAST: tl.constexpr, PREDICT: tl.constexpr, DELTA: tl.constexpr, DC: tl.constexpr,
    SCALE: tl.constexpr, DEVICE_STEP: tl.constexpr, LERP_SMALL: tl.constexpr,
):
    """The update of the elements ``offs`` (masked): what both the single-tensor and the
    multi-tensor kernel run."""
    if DEVICE_STEP:
        # the coefficients from the (already advanced) step and mu_product, in fp64:
        # mu_t = beta1 * (1 - 0.5 * 0.96^(t * psi))
        t = tl.load(step_ptr).to(tl.float64)
        prod = tl.load(prod_ptr).to(tl.float64)
        mu = beta1 * (1.0 - 0.5 * tl.exp(t * psi_log96))
        mu_next = beta1 * (1.0 - 0.5 * tl.exp((t + 1.0) * psi_log96))
        coef_g = (-lr * (1.0 - mu) / (1.0 - prod)).to(tl.float32)
        coef_m = (-lr * mu_next / (1.0 - prod * mu_next)).to(tl.float32)
        bc2 = (1.0 - tl.exp(t * log_beta2)).to(tl.float32)
    else:
        coef_g = host_coef_g
        coef_m = host_coef_m
        bc2 = host_bc2
    w, g, w_old, d = load_and_decay(param_ptr, grad_ptr, scale_ptr, delta_ptr, offs, mask,
                                    weight_decay, decay, dc_coef, SCALE, MAXIMIZE, WEIGHT_DECAY,
                                    DECOUPLED, DELTA, DC)

    m, v = adam_moments(m_ptr, v_ptr, offs, mask, g, w1, beta2, keep2, LERP_SMALL)
    denom = tl.sqrt_rn(tl.div_rn(v, bc2)) + eps
    w = w + coef_g * tl.div_rn(g, denom)
    w = w + coef_m * tl.div_rn(m, denom)

    store_step(param_ptr, last_ptr, pred_ptr, delta_ptr, offs, mask, w, w_old, d, horizon,
               gamma, keep_gamma, LAST, PREDICT, DELTA)


@triton.jit
def _nadam_kernel(
    param_ptr, grad_ptr, m_ptr, v_ptr, last_ptr, pred_ptr, delta_ptr, scale_ptr, inf_ptr,
    step_ptr, prod_ptr, lr_ptr, aux_ptr,
    n, lr, beta1, psi_log96, log_beta2, w1, beta2, keep2, eps, weight_decay, decay,
    host_bc2, host_coef_g, host_coef_m, horizon, gamma, keep_gamma, dc_coef,
    BLOCK: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr,
    DECOUPLED: tl.constexpr,
    MAXIMIZE: tl.constexpr,
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
    _nadam_body(param_ptr, grad_ptr, m_ptr, v_ptr, last_ptr, pred_ptr, delta_ptr, scale_ptr,
               step_ptr, prod_ptr, offs, mask, lr, beta1, psi_log96, log_beta2, w1, beta2,
               keep2, eps, weight_decay, decay, host_bc2, host_coef_g, host_coef_m, horizon,
               gamma, keep_gamma, dc_coef, WEIGHT_DECAY, DECOUPLED, MAXIMIZE, LAST, PREDICT,
               DELTA, DC, SCALE, DEVICE_STEP, LERP_SMALL)


#: operand rows of the multi-tensor table (triton_kernels/multi.py), in order; ``step`` and
#: ``prod`` (mu_product) are one-element rows
NADAM_ROLES = ("param", "grad", "m", "v", "last", "pred", "delta", "step", "prod")
NADAM_DTYPES = {"param": "PARAM_T", "grad": "GRAD_T", "m": "M_T", "v": "V_T",
                 "last": "LAST_T", "pred": "PRED_T", "delta": "DELTA_T", "step": "STEP_T",
                 "prod": "PROD_T"}


@triton.jit
def _nadam_multi_kernel(
    meta_ptr, chunk_ptr, nseg, scale_ptr, inf_ptr, lr_ptr, aux_ptr,
    lr, beta1, psi_log96, log_beta2, w1, beta2, keep2, eps, weight_decay, decay,
    host_bc2, host_coef_g, host_coef_m, horizon, gamma, keep_gamma, dc_coef,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    PARAM_T: tl.constexpr, GRAD_T: tl.constexpr, M_T: tl.constexpr, V_T: tl.constexpr,
    LAST_T: tl.constexpr, PRED_T: tl.constexpr, DELTA_T: tl.constexpr, STEP_T: tl.constexpr,
    PROD_T: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr,
    DECOUPLED: tl.constexpr,
    MAXIMIZE: tl.constexpr,
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
    _nadam_body(segment_ptr(meta_ptr, nseg, seg, 0, PARAM_T, ALIGNED),
               segment_ptr(meta_ptr, nseg, seg, 1, GRAD_T, ALIGNED),
               segment_ptr(meta_ptr, nseg, seg, 2, M_T, ALIGNED),
               segment_ptr(meta_ptr, nseg, seg, 3, V_T, ALIGNED),
               segment_ptr(meta_ptr, nseg, seg, 4, LAST_T, ALIGNED),
               segment_ptr(meta_ptr, nseg, seg, 5, PRED_T, ALIGNED),
               segment_ptr(meta_ptr, nseg, seg, 6, DELTA_T, ALIGNED), scale_ptr,
               segment_ptr(meta_ptr, nseg, seg, 7, STEP_T, False),
               segment_ptr(meta_ptr, nseg, seg, 8, PROD_T, False), offs, mask,
               lr, beta1, psi_log96, log_beta2, w1, beta2, keep2, eps, weight_decay, decay,
               host_bc2, host_coef_g, host_coef_m, horizon, gamma, keep_gamma, dc_coef,
               WEIGHT_DECAY, DECOUPLED, MAXIMIZE, LAST, PREDICT, DELTA, DC, SCALE, DEVICE_STEP,
               LERP_SMALL)
