"""Reference NAdam math: torch.optim.NAdam's single-tensor update, op for op, plus the delay
buffers, and AsyncPP's per-stage beta1 rule.

A module of its own beside ``functional`` (SGD and Adam) because NAdam carries a second
scalar state, ``mu_product`` (the product of Dozat's momentum schedule mu_1 ... mu_t), and a
schedule of its own; it shares the conventions of :mod:`engine.optim.functional` (fp32
state and math for bf16/fp16 params, one rounding on store, derived buffers from the stored
weights, AMP ``grad_scale``/``found_inf``). docs/ALGORITHMS.md, "NAdam for asynchronous
pipelines", has the formulas and their sources.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.optim.functional import _skip, _workspace, store_and_derive
from engine.optim.functional_dc import delay_compensate
from engine.optim.hyperparams import to_scalar
from engine.update_rules import as_compute as _as_f32
from engine.update_rules import check_dc, nadam_mu, validate_nadam_args

__all__ = ["nadam_update", "validate_nadam_args", "stage_beta1", "nadam_mu"]


def stage_beta1(beta1: float, beta1_max: float, num_stages: int, delay: int) -> float:
    """AsyncPP's per-stage beta1 (``--adaptive_momentum`` of PluralisResearch/AsyncPP):
    ``beta1 + (V_s - 1) * (beta1_max - beta1) / S`` with V_s the weight versions the stage
    keeps. Under PipeDream weight stashing V_s - 1 is the stage's delay D_s, which is what
    the engine knows per group, so this takes ``delay`` for V_s - 1."""
    return beta1 + delay * (beta1_max - beta1) / num_stages


def nadam_update(
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
    capturable: bool = False,
    differentiable: bool = False,
) -> None:
    """One NAdam step in place (``decoupled=True``: NAdamW, decay ``w *= 1 - lr * wd``).

    With the delay buffers off this is ``torch.optim.nadam._single_tensor_nadam`` op for op:
    ``step`` and ``mu_product`` are incremented/multiplied in place, mu and mu_next are
    Python floats from the step, the two ``addcdiv_`` apply ``(1 - mu) / (1 - prod mu)`` to
    the gradient and ``mu_next / (1 - prod mu * mu_next)`` to the first moment. With
    ``capturable``/``differentiable`` the coefficients stay tensors, as torch's path for
    those flags. ``last_update``, ``predicted`` and ``delta`` are written after the step
    as for Adam (:func:`engine.optim.functional.store_and_derive`). ``dc_coeff``: the
    delay-compensated gradient, as :func:`engine.optim.functional.adam_update`.
    """
    if validate:
        validate_nadam_args(param, grad, exp_avg, exp_avg_sq, mu_product, step,
                            last_update=last_update, predicted=predicted, delta=delta,
                            grad_scale=grad_scale, found_inf=found_inf)
        check_dc(dc_coeff, delta, param)
    if _skip(found_inf):
        return
    w = _as_f32(param)
    g = _as_f32(grad)
    if grad_scale is not None:
        g = g.div(grad_scale.float())
    if maximize:
        g = -g
    g = delay_compensate(g, delta, dc_coeff, _workspace)  # before the weight decay, as DC-ASGD
    w_old = w.clone() if (last_update is not None or predicted is not None
                          or delta is not None) else None
    target = param
    if torch.is_complex(w):  # as torch: everything on real views
        w = target = torch.view_as_real(param)
        g, exp_avg, exp_avg_sq = (torch.view_as_real(t) for t in (g, exp_avg, exp_avg_sq))
        last_update, predicted, delta, w_old = (
            None if t is None else torch.view_as_real(t)
            for t in (last_update, predicted, delta, w_old)
        )

    lr, beta1, beta2 = to_scalar(lr), to_scalar(beta1), to_scalar(beta2)
    step += 1
    t: Any = step if capturable else step.item()
    bias_correction2 = 1 - beta2**t
    if weight_decay != 0:
        if decoupled:
            w.mul_(1 - lr * weight_decay)
        else:
            g = g.add(w, alpha=weight_decay)
    mu = nadam_mu(beta1, momentum_decay, t)
    mu_next = nadam_mu(beta1, momentum_decay, t + 1)
    mu_product *= mu
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = exp_avg_sq.div(bias_correction2).sqrt()
    if differentiable or capturable:
        denom = denom.add(eps)
        mu_product_next = mu_product * mu_next
        w.addcdiv_(g * (-lr * (1.0 - mu) / (1.0 - mu_product)), denom)
        w.addcdiv_(exp_avg * (-lr * mu_next / (1.0 - mu_product_next)), denom)
    else:
        prod = mu_product.item()
        mu_product_next = prod * mu_next
        denom.add_(eps)
        w.addcdiv_(g, denom, value=-lr * (1.0 - mu) / (1.0 - prod))
        w.addcdiv_(exp_avg, denom, value=(-lr * mu_next) / (1.0 - mu_product_next))
    store_and_derive(target, w, w_old, last_update, predicted, predict_horizon, delta,
                     delta_gamma)
