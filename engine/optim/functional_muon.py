"""Reference Muon math: torch.optim.Muon's single-tensor update, op for op, on matrix views of
one buffer, AdamW for the parts that are not matrices, and the delay buffers of the engine.

A module of its own beside ``functional`` because Muon is not elementwise: each 2-D weight
is orthogonalised as a whole (Newton-Schulz on its momentum), so one update over a flat
arena bucket is a loop over the bucket's per-parameter views (``parts``), not one sweep.
Parameters that are not matrices (biases, gains, scalars) take AdamW through
:func:`engine.optim.functional.adam_update`, as Keller Jordan's ``MuonWithAuxAdam`` does.
The delay buffers (``last_update``, ``predicted``, PipeMare's ``delta``) are elementwise in
the applied step, so they are written once over the whole buffer
(:func:`engine.optim.functional.store_and_derive`). docs/ALGORITHMS.md, "Muon under delay",
has the formulas and their sources.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from engine.optim.functional import _as_f32, _skip, adam_update, store_and_derive

__all__ = [
    "ADJUST_LR_FNS",
    "EPS",
    "NS_COEFFICIENTS",
    "NS_STEPS",
    "adjust_lr",
    "matrix_update",
    "muon_update",
    "zeropower_via_newtonschulz",
]

# torch 2.13's defaults (torch/optim/_muon.py, from Keller Jordan's Muon post)
EPS = 1e-7
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
#: valid ``adjust_lr_fn`` values besides None (= "original"), as torch.optim.Muon
ADJUST_LR_FNS = ("original", "match_rms_adamw")

#: one part of a buffer: (param view, grad view, its state: "momentum_buffer" for a matrix,
#: "exp_avg"/"exp_avg_sq"/"step" otherwise)
Part = tuple[Tensor, Tensor, dict[str, Tensor]]


def zeropower_via_newtonschulz(
    g: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration, in bfloat16, op for op:
    X = bf16(G) (transposed when tall), X /= max(||X||_F, eps), then ``steps`` times
    A = X X^T, X = a X + (b A + c A A) X. Returns a new bf16 tensor shaped like ``g``."""
    a, b, c = coefficients
    x = g.bfloat16()
    if x is g:  # a bf16 input: do not scale the caller's tensor in place
        x = x.clone()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjust_lr(lr: float | Tensor, adjust_lr_fn: str | None, shape: Sequence[int]) -> float | Tensor:
    """The matrix's step size: lr * sqrt(max(1, A / B)) ("original", Keller Jordan) or
    lr * 0.2 * sqrt(max(A, B)) ("match_rms_adamw", Moonlight), A x B the shape (a Tensor
    lr gives a Tensor, as in torch)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r} is not one of None, {ADJUST_LR_FNS}")
    return lr * ratio


def matrix_update(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    lr: float | Tensor,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
    maximize: bool = False,
    grad_scale: Tensor | None = None,
) -> None:
    """One Muon step of one matrix in place: ``torch.optim._muon._single_tensor_muon`` op for
    op (B.lerp_(g, 1 - mu); U = g.lerp(B, mu) or B; O = NS(U); w *= 1 - lr * wd;
    w -= adjust_lr(lr) * O), with fp32 math and state for bf16/fp16 params."""
    w = _as_f32(param)
    g = _as_f32(grad)
    if grad_scale is not None:
        g = g.div(grad_scale.float())
    if maximize:
        g = -g
    momentum_buffer.lerp_(g, 1 - momentum)
    update = g.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    update = zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)
    adjusted = adjust_lr(lr, adjust_lr_fn, param.shape)
    w.mul_(1 - lr * weight_decay)
    w.add_(update, alpha=-adjusted)
    if w is not param:
        param.copy_(w)


def muon_update(
    param: Tensor,
    grad: Tensor,
    parts: Sequence[Part],
    *,
    lr: float | Tensor,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
    adamw_lr: float | Tensor,
    use_muon: bool = True,
    adamw_betas: tuple[float, float],
    adamw_eps: float,
    adamw_weight_decay: float,
    maximize: bool = False,
    last_update: Tensor | None = None,
    predicted: Tensor | None = None,
    predict_horizon: float = 0.0,
    delta: Tensor | None = None,
    delta_gamma: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One update of ``param`` (one tensor, or a flat buffer) whose ``parts`` are views of it.

    With ``use_muon`` a 2-D part takes :func:`matrix_update`; every other part AdamW
    (``adam_update`` with ``decoupled=True``: torch.optim.AdamW's single-tensor path, its own
    step count). Then,
    over the whole buffer and from the weights as stored, ``last_update = w_old - w``,
    ``predicted = w - H * (w_old - w)`` and PipeMare's ``delta``. A non-zero ``found_inf``
    skips everything (weights, state, buffers).
    """
    if _skip(found_inf):
        return
    derive = last_update is not None or predicted is not None or delta is not None
    w_old = _as_f32(param).clone() if derive else None
    for p, g, state in parts:
        if use_muon and p.dim() == 2:
            matrix_update(
                p, g, state["momentum_buffer"], lr=lr, weight_decay=weight_decay,
                momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients,
                ns_steps=ns_steps, eps=eps, adjust_lr_fn=adjust_lr_fn, maximize=maximize,
                grad_scale=grad_scale,
            )
        else:
            adam_update(
                p, g, state["exp_avg"], state["exp_avg_sq"], None, step=state["step"],
                lr=adamw_lr, beta1=adamw_betas[0], beta2=adamw_betas[1], eps=adamw_eps,
                weight_decay=adamw_weight_decay, decoupled=True, amsgrad=False,
                maximize=maximize, grad_scale=grad_scale, validate=False,
            )
    if derive:
        store_and_derive(param, _as_f32(param), w_old, last_update, predicted,
                         predict_horizon, delta, delta_gamma)
