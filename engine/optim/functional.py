"""Reference optimizer math: readable plain-torch updates that define what the kernels compute.

Every optimizer in ``engine.optim`` has two paths with the same signature: the functions here
(the reference, written with the same torch ops in the same order as ``torch.optim``'s
single-tensor implementations) and the fused Triton kernels in ``engine.triton_kernels`` (one pass
over memory). Tests hold the two together, and hold this module to ``torch.optim.SGD`` /
``Adam`` / ``AdamW`` bit for bit with the delay mitigations off. That is why the code below
looks clumsy in places (``g.add(w, alpha=wd)`` rather than ``g + wd * w``, ``lerp_`` for
Adam's first moment, bias corrections as Python floats): each choice mirrors torch's rounding.

The mitigations (spike compensation, weight prediction, PipeMare's discrepancy buffer) follow
the "Update rules" of docs/ALGORITHMS.md. Conventions this module fixes:

* Optimizer state (momentum buffer, moments, ``delta``, ``last_update``) is fp32 for fp32,
  bf16 and fp16 parameters and fp64 for fp64 ones (:func:`state_dtype`); the moments of
  bf16/fp16 params may be kept in their dtype (:func:`moment_dtypes`, the optimizers'
  ``state_dtype``): loaded up to fp32 for the same math, rounded once when stored. Low-precision
  (bf16/fp16) parameters and gradients are upcast to fp32, all math runs in fp32 and the new
  weights are rounded once (round to nearest even) when stored. For fp32 and fp64
  parameters the update runs in place on the parameter with torch's ops. Complex parameters
  are handled as torch.optim does: SGD updates them as complex tensors, Adam applies its L2
  weight decay on the complex tensors and the rest on real views (``torch.view_as_real``).
* Quantities derived from weights (predicted weights, ``delta``, ``last_update``) use the
  weights *as stored* (after rounding to the parameter dtype), so an on-demand
  :func:`predict` after the step reproduces the in-step prediction exactly.
* AMP: ``grad_scale`` divides the gradient; a non-zero ``found_inf`` skips the whole update
  (weights, state, derived buffers and Adam's step counter are left untouched).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.optim.functional_dc import delay_compensate
from engine.optim.hyperparams import decay_grad as _decay_grad
from engine.optim.hyperparams import to_scalar
from engine.update_rules import (  # noqa: F401 (re-exported: the rules the kernels share)
    _NATIVE,
    LOW_PRECISION,
    check_dc,
    check_like,
    moment_dtypes,
    spike_coeffs,
    state_dtype,
    validate_adam_args,
    validate_sgd_args,
)
from engine.update_rules import PARAM_DTYPES as _PARAM_DTYPES  # noqa: F401
from engine.update_rules import as_compute as _as_f32

__all__ = [
    "spike_coeffs",
    "prediction_coeff",
    "sgd_update",
    "adam_update",
    "predict",
    "predict_into",
    "validate_sgd_args",
    "validate_adam_args",
    "state_dtype",
    "moment_dtypes",
]

from engine.optim.functional_sparse import sgd_sparse_update  # noqa: F401 (re-exported)


# --------------------------------------------------------------------------- coefficients


def prediction_coeff(mode: str, lr: float, momentum: float, horizon: float) -> float:
    """Coefficient c of a weight prediction ``w_hat = w - c * v`` (ALGORITHMS.md).

    ``"linear"``: ``c = lr * H`` (LWP, SpecTrain). ``"momentum"``: ``c = lr * (m + m^2 + ... +
    m^H)``, the exact extrapolation of momentum SGD when no new gradient arrives (H = 1 is
    the Nesterov look-ahead); H must then be an integer.
    """
    if horizon < 0:
        raise ValueError(f"prediction horizon must be >= 0, got {horizon!r}")
    if mode == "linear":
        return lr * horizon
    if mode == "momentum":
        if int(horizon) != horizon:
            raise ValueError(f"'momentum' prediction needs an integer horizon, got {horizon!r}")
        total, power = 0.0, 1.0
        for _ in range(int(horizon)):
            power *= momentum
            total += power
        return lr * total
    raise ValueError(f"prediction mode must be 'linear' or 'momentum', got {mode!r}")


def _skip(found_inf: Tensor | None) -> bool:
    # reference path: a host read is fine here (the fused path never syncs)
    return found_inf is not None and bool(found_inf.item() != 0)


_WORKSPACE: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _workspace(like: Tensor) -> Tensor:
    """A scratch tensor shaped like ``like`` (contents undefined), carved from one buffer per
    (dtype, device) that grows to the largest request and is reused by every call (not for
    a differentiable step, which needs its own temporaries). CPU only: on a GPU the caching
    allocator already reuses memory, and steps on concurrent streams must not share one."""
    if like.device.type != "cpu":
        return torch.empty_like(like)
    key = (like.dtype, like.device)
    buf = _WORKSPACE.get(key)
    n = like.numel()
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=like.dtype, device=like.device)
        _WORKSPACE[key] = buf
    return buf[:n].view(like.shape)


# --------------------------------------------------------------------------- prediction


def _minus_scaled(param: Tensor, direction: Tensor, coeff: float | Tensor,
                  out: Tensor | None = None) -> Tensor:
    """``param - coeff * direction`` in one op. A Tensor ``coeff`` (from a device lr,
    ``engine.update_rules.lr_product``) stays on the device: no host read, so a captured
    window can recompute a prediction."""
    if isinstance(coeff, Tensor):
        return torch.addcmul(param, direction, coeff.neg(), out=out)
    return torch.add(param, direction, alpha=-coeff, out=out)


def predict(param: Tensor, direction: Tensor, coeff: float | Tensor) -> Tensor:
    """``w - coeff * direction`` as a new tensor in the param's dtype (fp32 math)."""
    check_like("direction", direction, param, None)
    out = _minus_scaled(_as_f32(param), _as_f32(direction), coeff)
    return out if out.dtype == param.dtype else out.to(param.dtype)


def predict_into(out: Tensor, param: Tensor, direction: Tensor, coeff: float | Tensor) -> None:
    """:func:`predict` written into ``out`` (the param's dtype and shape), without a
    temporary when everything is fp32 (the same single op, so bit-identical)."""
    if param.dtype == direction.dtype == out.dtype and param.dtype in _NATIVE:
        _minus_scaled(param, direction, coeff, out=out)
    else:
        out.copy_(predict(param, direction, coeff))


# --------------------------------------------------------------------------- SGD


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
) -> None:
    """One momentum-SGD step in place, torch.optim.SGD's op order (ALGORITHMS.md).

    ::

        g  = grad (/ grad_scale), negated if maximize
        g  = g + dc_coeff * g * g * delta   if dc_coeff != 0 (delay compensation)
        g' = g + wd * w
        v  = g' on the first step (init_momentum), else m * v + (1 - d) * g'
        u  = b * g' + a * v  if sc_delay > 0   (spike compensation; supersedes nesterov,
             g' + m * v      elif nesterov       since D = 1 *is* Nesterov)
             v               otherwise;  u = g' when momentum == 0 (no buffer)
        w  = w - lr * u

    Optional outputs: ``predicted = w_new - predict_coeff * v_new`` (``v_new = g'`` without
    momentum) in the param's dtype; ``delta = gamma * delta + (1 - gamma) * (w_new - w_old)``.
    """
    if validate:  # the optimizers validate once per layout and pass validate=False
        validate_sgd_args(param, grad, momentum_buffer, momentum=momentum,
                          dampening=dampening, sc_delay=sc_delay, predicted=predicted,
                          delta=delta, grad_scale=grad_scale, found_inf=found_inf)
        check_dc(dc_coeff, delta, param)
    if _skip(found_inf):
        return
    w = _as_f32(param)  # fp32 params: the param itself, updated in place like torch
    g = _as_f32(grad)
    if grad_scale is not None:
        g = g.div(grad_scale.float())
    if maximize:
        g = -g
    g = delay_compensate(g, delta, dc_coeff, _workspace)
    w_old = w.clone() if delta is not None else None
    lr = to_scalar(lr)

    if weight_decay != 0:
        g = _decay_grad(g, w, weight_decay)

    stored_buf = None
    if momentum != 0 and momentum_buffer.dtype != w.dtype:
        # a bf16/fp16 buffer (state_dtype): fp32 math on a copy, rounded once when stored
        stored_buf, momentum_buffer = momentum_buffer, momentum_buffer.float()
    if momentum != 0:
        buf = momentum_buffer
        if init_momentum:
            buf.copy_(g.detach())  # torch: buf = grad.detach().clone()
        else:
            buf.mul_(momentum).add_(g, alpha=1 - dampening)
        if sc_delay > 0:
            a, b = spike_coeffs(momentum, sc_delay)
            # (1 - d) on the spike term keeps a gradient's total contribution that of
            # undelayed SGD with dampening (ALGORITHMS.md); D = 1, d = 0: b == 1.0, identical
            # to nesterov below
            # the same two ops as before, into a reused workspace: a fresh weight-sized
            # temporary per call costs page faults that dwarf the arithmetic on CPU
            if torch.is_grad_enabled() and (g.requires_grad or buf.requires_grad):
                upd = g.mul(b * (1 - dampening)).add(buf, alpha=a)  # differentiable step
            else:
                upd = torch.mul(g, b * (1 - dampening), out=_workspace(g)).add_(buf, alpha=a)
        elif nesterov:
            upd = g.add(buf, alpha=momentum)
        else:
            upd = buf
        direction = buf
    else:
        upd = g
        direction = g

    if isinstance(lr, Tensor) and lr.requires_grad:
        w.addcmul_(upd, lr, value=-1)  # as torch: alpha= would cut the gradient to lr
    else:
        w.add_(upd, alpha=-lr)
    if w is not param:
        param.copy_(w)
        w = _as_f32(param)  # derived buffers use the stored (rounded) weights
    if stored_buf is not None:
        stored_buf.copy_(buf)
        direction = stored_buf  # the prediction reads the buffer as stored, as predict() would

    if predicted is not None:
        predict_into(predicted, param, direction, predict_coeff)
    if delta is not None:
        delta.mul_(delta_gamma).add_(w.sub(w_old), alpha=1 - delta_gamma)


# --------------------------------------------------------------------------- Adam


def adam_update(
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
    capturable: bool = False,
    differentiable: bool = False,
) -> None:
    """One Adam (``decoupled=False``) or AdamW (``decoupled=True``) step in place.

    With the mitigations off this is torch.optim.Adam/AdamW's single-tensor path op for op
    (``step`` is incremented in place first and read as a Python float, bias corrections are
    Python floats, ``lerp_`` for the first moment, ``addcdiv_`` for the update). With
    ``capturable`` or ``differentiable`` the bias corrections stay tensors computed from
    ``step`` (no host read, so the step can be captured in a CUDA graph; autograd can go
    through it), again op for op as torch's path for those flags.

    Delay compensation for Adam is this project's own derivation (ALGORITHMS.md, "Adam / AdamW
    with delay compensation"), not a published method:

    * Spike compensation SC_D replaces the bias-corrected first moment in the numerator by
      ``b1^D * u_hat + (1 - b1^D) * g`` with ``u_hat = u / (1 - b1^t)``. The bias correction
      is applied to ``u`` only, because ``g`` is already an unbiased single sample; then the
      weights of every gradient still sum to one (at t = 1 the numerator is exactly g), and
      a gradient's contribution k >= 1 steps later equals plain Adam's contribution k + D
      steps later, which is what spike compensation means. D = 1 is NAdam's numerator with
      constant momentum (Dozat's form).
    * Prediction extrapolates the last applied step: ``w_hat = w_new - H * (w_old - w_new)``.
      ``last_update`` (if given) keeps ``w_old - w_new`` so a prediction at another horizon
      can be made later with ``predict(param, last_update, H)``. Under AdamW the applied
      step includes the decoupled decay.
    * ``dc_coeff`` (lambda * tau_s): the gradient becomes g + dc_coeff * g * g * delta before
      the weight decay and the moments (:mod:`engine.optim.functional_dc`).
    """
    if validate:  # the optimizers validate once per layout and pass validate=False
        validate_adam_args(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step,
                           amsgrad=amsgrad, sc_delay=sc_delay, last_update=last_update,
                           predicted=predicted, delta=delta, grad_scale=grad_scale,
                           found_inf=found_inf)
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

    lr, beta1, beta2 = to_scalar(lr), to_scalar(beta1), to_scalar(beta2)
    step += 1
    if weight_decay != 0:
        if decoupled:
            w.mul_(1 - lr * weight_decay)
        else:
            g = _decay_grad(g, w, weight_decay)

    if torch.is_complex(w):  # as torch: the weight decay above on complex, the rest on real views
        w = param = torch.view_as_real(param)
        g, exp_avg, exp_avg_sq = (torch.view_as_real(t) for t in (g, exp_avg, exp_avg_sq))
        max_exp_avg_sq, last_update, predicted, delta, w_old = (
            None if t is None else torch.view_as_real(t)
            for t in (max_exp_avg_sq, last_update, predicted, delta, w_old)
        )

    # bf16/fp16 moments (state_dtype): fp32 math on copies, each rounded once when stored
    stored = [(t, t.float()) for t in (exp_avg, exp_avg_sq, max_exp_avg_sq)
              if t is not None and t.dtype != w.dtype]
    if stored:
        work = {id(t): c for t, c in stored}
        exp_avg, exp_avg_sq = work.get(id(exp_avg), exp_avg), work.get(id(exp_avg_sq), exp_avg_sq)
        if max_exp_avg_sq is not None:
            max_exp_avg_sq = work.get(id(max_exp_avg_sq), max_exp_avg_sq)

    # torch casts a Tensor beta1 to the param's dtype for lerp_
    b1 = beta1.to(device=w.device, dtype=w.dtype) if isinstance(beta1, Tensor) else beta1
    exp_avg.lerp_(g, 1 - b1)
    if isinstance(beta2, Tensor) and beta2.requires_grad:
        # as torch: value= takes numbers only; lerp is the same update and keeps the graph
        exp_avg_sq.lerp_(torch.square(g), weight=1 - beta2)
    else:
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)

    if capturable or differentiable:
        _adam_tensor_step(w, g, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr=lr, beta1=beta1,
                          beta2=beta2, eps=eps, amsgrad=amsgrad, sc_delay=sc_delay,
                          differentiable=differentiable)
    else:
        t = step.item()
        bias_correction1 = 1 - beta1**t
        bias_correction2 = 1 - beta2**t
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5

        if amsgrad:
            torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)

        if sc_delay > 0:
            a = beta1 ** int(sc_delay)
            numer = exp_avg.mul(a / bias_correction1).add_(g, alpha=1 - a)
            w.addcdiv_(numer, denom, value=-lr)
        else:
            w.addcdiv_(exp_avg, denom, value=-step_size)

    for target, value in stored:
        target.copy_(value)
    store_and_derive(param, w, w_old, last_update, predicted, predict_horizon, delta, delta_gamma)


def store_and_derive(param: Tensor, w: Tensor, w_old: Tensor | None, last_update: Tensor | None,
                     predicted: Tensor | None, predict_horizon: float, delta: Tensor | None,
                     delta_gamma: float) -> None:
    """Store the fp32 result ``w`` into ``param`` (rounding once) and write the buffers derived
    from the applied step, from the weights as stored: ``last_update = w_old - w``, the
    prediction ``w - H * (w_old - w)`` and PipeMare's ``delta`` (the Adam-family tail)."""
    if w is not param:
        param.copy_(w)
        w = _as_f32(param)
    if last_update is not None or predicted is not None:
        applied = w_old.sub(w)
        if last_update is not None:
            last_update.copy_(applied)
        if predicted is not None:
            predict_into(predicted, param, applied, predict_horizon)
    if delta is not None:
        delta.mul_(delta_gamma).add_(w.sub(w_old), alpha=1 - delta_gamma)


def _adam_tensor_step(
    w: Tensor, g: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, max_exp_avg_sq: Tensor | None,
    step: Tensor, *, lr: float, beta1: float, beta2: float, eps: float, amsgrad: bool,
    sc_delay: int, differentiable: bool,
) -> None:
    """Adam's weight update with tensor bias corrections (torch's capturable/differentiable
    path): the step count is never read on the host. A beta that requires grad reads a copy
    of ``step`` (autograd saves it, and the next step increments ``step`` in place)."""
    def power(beta: Any) -> Any:
        grad_beta = isinstance(beta, Tensor) and beta.requires_grad
        return beta ** (step.clone() if grad_beta else step)

    bias_correction1 = 1 - power(beta1)
    bias_correction2 = 1 - power(beta2)
    bias_correction2_sqrt = bias_correction2.sqrt()
    if amsgrad:
        assert max_exp_avg_sq is not None
        current = max_exp_avg_sq.clone() if differentiable else max_exp_avg_sq
        max_exp_avg_sq.copy_(torch.maximum(current, exp_avg_sq))
        second = max_exp_avg_sq
    else:
        second = exp_avg_sq
    first = exp_avg.clone() if differentiable else exp_avg
    if sc_delay > 0:
        # spike compensation needs the plain denominator (its numerator mixes two terms)
        a = beta1 ** int(sc_delay)
        denom = (second.sqrt() / bias_correction2_sqrt).add_(eps)
        numer = first.mul(a / bias_correction1).add_(g, alpha=1 - a)
        w.addcdiv_(numer, denom, value=-lr)
        return
    step_size_neg = (lr / bias_correction1).neg()
    denom = (second.sqrt() / (bias_correction2_sqrt * step_size_neg)).add_(eps / step_size_neg)
    w.addcdiv_(first, denom)
