"""Fused NAdam / NAdamW step: one pass over a flat buffer (or one tensor) per call.

Reads w, g, exp_avg, exp_avg_sq once and writes the new weights and moments, plus, when
asked, the applied update (``last_update``), the predicted weights and PipeMare's ``delta``
in the same pass. The math is ``engine.optim.functional_nadam.nadam_update``: fp32
arithmetic, torch's lerp for the first moment, IEEE-rounded sqrt and division, bf16/fp16
weights rounded to nearest even once on store.

Why the scalars are computed on the host: NAdam's coefficients need mu_t, mu_{t+1} and the
running product prod mu_1..mu_t, which torch forms in Python floats from the step count.
The launcher advances ``step`` and ``mu_product`` with the same tensor ops as the reference
(so the state stays bit-identical to it), reads both once, and passes the two
coefficients. That is one host read of the step (and of ``found_inf`` under AMP) per call,
as torch's own non-capturable NAdam; an on-device variant, as Adam's kernel has, is not
written yet.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from engine.optim.functional_nadam import nadam_mu, validate_nadam_args
from engine.triton_kernels._launch import (
    GPU_WARPS,
    check_launchable,
    default_block,
    grid_for,
    interpreting,
    placeholder,
)
from engine.triton_kernels.adam import adam_moments, store_step

__all__ = ["fused_nadam_update", "nadam_kernel", "launch_nadam"]


@triton.jit
def nadam_kernel(
    param_ptr, grad_ptr, m_ptr, v_ptr, last_ptr, pred_ptr, delta_ptr, scale_ptr,
    n, w1, beta2, keep2, eps, weight_decay, decay, bc2, coef_g, coef_m,
    horizon, gamma, keep_gamma,
    BLOCK: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr,
    DECOUPLED: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    LAST: tl.constexpr,
    PREDICT: tl.constexpr,
    DELTA: tl.constexpr,
    SCALE: tl.constexpr,
    LERP_SMALL: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    w = tl.load(param_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    if SCALE:
        g = tl.div_rn(g, tl.load(scale_ptr).to(tl.float32))
    if MAXIMIZE:
        g = -g
    w_old = w
    if WEIGHT_DECAY:
        if DECOUPLED:
            w = w * decay
        else:
            g = g + weight_decay * w

    m, v = adam_moments(m_ptr, v_ptr, offs, mask, g, w1, beta2, keep2, LERP_SMALL)
    denom = tl.sqrt_rn(tl.div_rn(v, bc2)) + eps
    w = w + coef_g * tl.div_rn(g, denom)
    w = w + coef_m * tl.div_rn(m, denom)

    store_step(param_ptr, last_ptr, pred_ptr, delta_ptr, offs, mask, w, w_old, horizon, gamma,
               keep_gamma, LAST, PREDICT, DELTA)


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
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    validate: bool = True,
    block: int | None = None,
) -> None:
    """:func:`fused_nadam_update` with an explicit block size (tests cover several programs)."""
    if validate:
        validate_nadam_args(param, grad, exp_avg, exp_avg_sq, mu_product, step,
                            last_update=last_update, predicted=predicted, delta=delta,
                            grad_scale=grad_scale, found_inf=found_inf)
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"NAdam needs 0 <= beta < 1, got beta1={beta1!r}, beta2={beta2!r}")
    check_launchable({"param": param, "grad": grad, "exp_avg": exp_avg,
                      "exp_avg_sq": exp_avg_sq, "last_update": last_update,
                      "predicted": predicted, "delta": delta})
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

    n = param.numel()
    if n == 0:
        return
    block = block or default_block(param, grad, exp_avg)
    nadam_kernel[grid_for(n, block)](
        param, grad, exp_avg, exp_avg_sq,
        placeholder(last_update, param), placeholder(predicted, param),
        placeholder(delta, param), placeholder(grad_scale, param),
        n, float(1 - beta1), float(beta2), float(1 - beta2), float(eps),
        float(weight_decay), float(1 - lr * weight_decay), float(1 - beta2**t),
        float(coef_g), float(coef_m),
        float(predict_horizon), float(delta_gamma), float(1 - delta_gamma),
        BLOCK=block,
        WEIGHT_DECAY=weight_decay != 0,
        DECOUPLED=weight_decay != 0 and bool(decoupled),
        MAXIMIZE=bool(maximize),
        LAST=last_update is not None,
        PREDICT=predicted is not None,
        DELTA=delta is not None,
        SCALE=grad_scale is not None,
        LERP_SMALL=abs(1 - beta1) < 0.5,
        num_warps=1 if interpreting() else GPU_WARPS,
    )


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
                 grad_scale=grad_scale, found_inf=found_inf, validate=validate)
