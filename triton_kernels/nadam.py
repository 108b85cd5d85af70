"""Fused NAdam / NAdamW step: one pass over a flat buffer (or one tensor) per call.

The update itself is a ``@triton.jit`` body (``nadam_body``) that two kernels call:
``nadam_kernel`` over one tensor, and ``nadam_multi_kernel`` over the segments of a
``SegmentTable`` (many tensors or flat buckets of one param group, one launch; see
triton_kernels/multi.py), so both compute the same bits.

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

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.optim.functional_dc import check_dc
from engine.optim.functional_nadam import nadam_mu, validate_nadam_args
from engine.triton_kernels._launch import (
    GPU_WARPS,
    block_offsets,
    check_launchable,
    default_block,
    grid_for,
    interpreting,
    load_and_decay,
    placeholder,
)
from engine.triton_kernels.adam import _advance_steps, _log, adam_moments, store_step
from engine.triton_kernels.multi import (
    SegmentTable,
    check_roles,
    launch_segments,
    segment_offsets,
    segment_ptr,
)

__all__ = ["fused_nadam_update", "fused_nadam_multi", "nadam_kernel", "nadam_multi_kernel",
           "launch_nadam", "NADAM_ROLES"]


@triton.jit
def nadam_body(
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
def nadam_kernel(
    param_ptr, grad_ptr, m_ptr, v_ptr, last_ptr, pred_ptr, delta_ptr, scale_ptr, inf_ptr,
    step_ptr, prod_ptr,
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
):
    offs, mask = block_offsets(n, inf_ptr, BLOCK, CHECK_INF)
    nadam_body(param_ptr, grad_ptr, m_ptr, v_ptr, last_ptr, pred_ptr, delta_ptr, scale_ptr,
               step_ptr, prod_ptr, offs, mask, lr, beta1, psi_log96, log_beta2, w1, beta2,
               keep2, eps, weight_decay, decay, host_bc2, host_coef_g, host_coef_m, horizon,
               gamma, keep_gamma, dc_coef, WEIGHT_DECAY, DECOUPLED, MAXIMIZE, LAST, PREDICT,
               DELTA, DC, SCALE, DEVICE_STEP, LERP_SMALL)


#: operand rows of the multi-tensor table (triton_kernels/multi.py), in order; ``step`` and
#: ``prod`` (mu_product) are one-element rows
NADAM_ROLES = ("param", "grad", "m", "v", "last", "pred", "delta", "step", "prod")
_NADAM_DTYPES = {"param": "PARAM_T", "grad": "GRAD_T", "m": "M_T", "v": "V_T",
                 "last": "LAST_T", "pred": "PRED_T", "delta": "DELTA_T", "step": "STEP_T",
                 "prod": "PROD_T"}


@triton.jit
def nadam_multi_kernel(
    meta_ptr, chunk_ptr, nseg, scale_ptr, inf_ptr,
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
):
    seg, offs, mask = segment_offsets(meta_ptr, chunk_ptr, nseg, inf_ptr, 9, BLOCK, ALIGNED,
                                      CHECK_INF)
    nadam_body(segment_ptr(meta_ptr, nseg, seg, 0, PARAM_T, ALIGNED),
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


def _advance_on_device(step: Tensor, mu_product: Tensor, found_inf: Tensor | None, beta1: float,
                       momentum_decay: float) -> None:
    """Device ops only: step += (no overflow); mu_product *= mu_t (1 on an overflow)."""
    _advance_steps([step], found_inf)
    mu_t = beta1 * (1.0 - 0.5 * torch.pow(0.96, step.double() * momentum_decay))
    if found_inf is not None:
        mu_t = torch.where(found_inf.reshape(()) == 0, mu_t, torch.ones_like(mu_t))
    mu_product.mul_(mu_t.float())  # fp32 times fp32 mu, as the reference's mu_product *= mu


def _nadam_args(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                momentum_decay: float, decoupled: bool, maximize: bool,
                host: tuple[float, float, float], predict_horizon: float, delta_gamma: float,
                dc_coeff: float, last: bool, predict: bool, delta: bool, scale: bool,
                check_inf: bool, device_step: bool) -> tuple[tuple[float, ...], dict]:
    """The kernels' float arguments and constexpr flags (shared by both launchers); ``host``:
    the host-computed bc2 and the two coefficients (unused with ``device_step``)."""
    scalars = (float(lr), float(beta1), momentum_decay * math.log(0.96), _log(beta2),
               float(1 - beta1), float(beta2), float(1 - beta2), float(eps),
               float(weight_decay), float(1 - lr * weight_decay), *map(float, host),
               float(predict_horizon), float(delta_gamma), float(1 - delta_gamma),
               float(dc_coeff))
    flags = dict(
        WEIGHT_DECAY=weight_decay != 0,
        DECOUPLED=weight_decay != 0 and bool(decoupled),
        MAXIMIZE=bool(maximize),
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


def launch_nadam(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    mu_product: Tensor,
    *,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    momentum_decay: float,
    decoupled: bool,
    maximize: bool,
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
    """:func:`fused_nadam_update` with an explicit block size and coefficient mode.

    ``device_step=None`` computes the coefficients in the kernel when ``step`` and
    ``mu_product`` live on the param's device (no host read); ``False`` forces the host
    path (tests cover it on CPU)."""
    if validate:
        validate_nadam_args(param, grad, exp_avg, exp_avg_sq, mu_product, step,
                            last_update=last_update, predicted=predicted, delta=delta,
                            grad_scale=grad_scale, found_inf=found_inf)
    check_dc(dc_coeff, delta, param)  # also unvalidated: DC reads the delta pointer
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"NAdam needs 0 <= beta < 1, got beta1={beta1!r}, beta2={beta2!r}")
    check_launchable({"param": param, "grad": grad, "exp_avg": exp_avg,
                      "exp_avg_sq": exp_avg_sq, "last_update": last_update,
                      "predicted": predicted, "delta": delta})
    on_device = step.device == param.device and mu_product.device == param.device
    if device_step is None:
        device_step = on_device
    elif device_step and not on_device:
        raise ValueError("device_step=True needs step and mu_product on the param's device")
    bc2 = coef_g = coef_m = 0.0
    if device_step:
        _advance_on_device(step, mu_product, found_inf, beta1, momentum_decay)
    else:
        if found_inf is not None and found_inf.item() != 0:
            return  # an overflowed AMP step changes nothing, state included
        # the scalar state advances with the reference's ops, so it stays bit-identical to it
        step += 1
        t = step.item()
        mu = nadam_mu(beta1, momentum_decay, t)
        mu_next = nadam_mu(beta1, momentum_decay, t + 1)
        mu_product *= mu
        prod = mu_product.item()
        coef_g = -lr * (1.0 - mu) / (1.0 - prod)
        coef_m = (-lr * mu_next) / (1.0 - prod * mu_next)
        bc2 = 1 - beta2**t

    n = param.numel()
    if n == 0:
        return
    scalars, flags = _nadam_args(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        momentum_decay=momentum_decay, decoupled=decoupled, maximize=maximize,
        host=(bc2, coef_g, coef_m), predict_horizon=predict_horizon, delta_gamma=delta_gamma,
        dc_coeff=dc_coeff, last=last_update is not None, predict=predicted is not None,
        delta=delta is not None, scale=grad_scale is not None,
        check_inf=bool(device_step) and found_inf is not None, device_step=device_step)
    block = block or default_block(param, grad, exp_avg)
    nadam_kernel[grid_for(n, block)](
        param, grad, exp_avg, exp_avg_sq,
        placeholder(last_update, param), placeholder(predicted, param),
        placeholder(delta, param), placeholder(grad_scale, param),
        placeholder(found_inf if device_step else None, param),
        step if device_step else param, mu_product if device_step else param,
        n, *scalars, BLOCK=block, **flags)


def fused_nadam_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    mu_product: Tensor,
    *,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    momentum_decay: float,
    decoupled: bool,
    maximize: bool,
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
    """Fused equivalent of ``engine.optim.functional_nadam.nadam_update`` (same signature and
    semantics); all tensors must be contiguous and on one device (``step`` and
    ``mu_product`` may live on the CPU)."""
    launch_nadam(param, grad, exp_avg, exp_avg_sq, mu_product, step=step, lr=lr, beta1=beta1,
                 beta2=beta2, eps=eps, weight_decay=weight_decay,
                 momentum_decay=momentum_decay, decoupled=decoupled, maximize=maximize,
                 last_update=last_update, predicted=predicted,
                 predict_horizon=predict_horizon, delta=delta, delta_gamma=delta_gamma,
                 dc_coeff=dc_coeff, grad_scale=grad_scale, found_inf=found_inf, validate=validate)


def fused_nadam_multi(
    table: SegmentTable,
    grads: object = None,
    exp_avgs: object = None,
    exp_avg_sqs: object = None,
    mu_products: object = None,
    *,
    step: object = None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    momentum_decay: float,
    decoupled: bool,
    maximize: bool,
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
    """:func:`fused_nadam_update` over every segment of ``table`` (roles :data:`NADAM_ROLES`)
    in one launch. Each distinct (step, mu_product) pair advances first with the single
    launcher's device ops (a few tiny ops per pair: the momentum product is sequential
    state, kept bit-identical to the single-tensor path). The tensor arguments only say which
    operands the caller means and must agree with the table."""
    check_roles(table, {"grad": True, "m": True, "v": True, "last": last_update is not None,
                        "pred": predicted is not None, "delta": delta is not None,
                        "step": True, "prod": True})
    if validate:
        for p, g, m, v, last, pred, d, st, prod in table.segments(NADAM_ROLES):
            validate_nadam_args(p, g, m, v, prod, st, last_update=last, predicted=pred,
                                delta=d, grad_scale=grad_scale, found_inf=found_inf)
    param = table.tensors("param")[0]
    check_dc(dc_coeff, table.first("delta"), param)
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"NAdam needs 0 <= beta < 1, got beta1={beta1!r}, beta2={beta2!r}")
    pairs = list({id(s): (s, p) for s, p in zip(table.tensors("step"), table.tensors("prod"),
                                                strict=True)}.values())
    if any(s.device != table.device or p.device != table.device for s, p in pairs):
        raise ValueError(f"the multi-tensor launch needs step and mu_product on {table.device}; "
                         "use fused_nadam_update for CPU ones")
    for s, p in pairs:
        _advance_on_device(s, p, found_inf, beta1, momentum_decay)
    scalars, flags = _nadam_args(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        momentum_decay=momentum_decay, decoupled=decoupled, maximize=maximize,
        host=(0.0, 0.0, 0.0), predict_horizon=predict_horizon, delta_gamma=delta_gamma,
        dc_coeff=dc_coeff, last=table.has("last"), predict=table.has("pred"),
        delta=table.has("delta"), scale=grad_scale is not None,
        check_inf=found_inf is not None, device_step=True)
    launch_segments(nadam_multi_kernel, table, _NADAM_DTYPES, scalars, flags, grad_scale, found_inf)
