"""Delay-compensated gradients: DC-ASGD's first-order correction with PipeMare's delta buffer.

Why a module of its own: the term is shared by every family (SGD, Adam/AdamW, NAdam), runs
before anything else of their updates touches the gradient, and is this project's own
combination of two published pieces (docs/ALGORITHMS.md, "Delay-compensated gradients"):

* DC-ASGD (Zheng et al., ICML 2017, "Asynchronous Stochastic Gradient Descent with Delay
  Compensation"; their MXNet ``DCASGD`` optimizer) replaces a gradient computed at stale
  weights w_(t-tau) by its Taylor estimate at the current weights, with the diagonal
  outer-product approximation of the Hessian: ``g + lambda * g * g * (w_t - w_(t-tau))``
  (the constant-lambda form; the adaptive DC-ASGD-a is not implemented).
* PipeMare's T2 buffer (Yang et al., MLSys 2021) ``delta`` is an EMA of the per-step weight
  change, and ``tau_s * delta`` is T2's own estimate of w_t - w_(t-tau_s); no weight snapshot
  is kept. With T2 on it is exactly the difference between the live weights and the weights
  the backward used (w_t - tau_s * delta_t), so DC adds no buffer there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["delay_compensate"]


def delay_compensate(g: Tensor, delta: Tensor | None, coeff: float,
                     scratch: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """``g + coeff * (g * g * delta)`` as a new tensor (``coeff`` = lambda * tau_s, ``delta``
    as it stands before this step's update); ``g`` itself when ``coeff`` is 0, so that an
    update with the option off is bitwise what it was without it. ``scratch(g)``: a reusable
    tensor shaped like ``g`` for the product (a fresh weight-sized temporary costs page
    faults on CPU that rival the arithmetic); not used when autograd records the step."""
    if coeff == 0:
        return g
    if delta is None:
        raise ValueError(f"dc_coeff={coeff!r} needs delta (the estimate of w_t - w_(t-tau))")
    if scratch is None or (torch.is_grad_enabled() and (g.requires_grad or delta.requires_grad)):
        return g.add(g.mul(g).mul_(delta), alpha=coeff)
    return g.add(torch.mul(g, g, out=scratch(g)).mul_(delta), alpha=coeff)
