"""Tensor hyperparameters, taken the way torch.optim's single-tensor paths take them.

Why a module: torch accepts ``lr``, ``betas`` and ``weight_decay`` as Tensors, of any shape
with one element, and with ``differentiable=True`` autograd must reach them through the step
(torch's suite checks both). The reference math (functional.py,
functional_nadam.py) routes them through these helpers so that the float path stays torch's
op for op and only Tensor values take the tensor-friendly ops.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["decay_grad", "to_scalar"]


def to_scalar(x: Any) -> Any:
    """torch.optim's ``_to_scalar``: a 1-element Tensor hyperparameter of any shape becomes a
    0-dim Tensor (a view: autograd still reaches the original), a number stays a number. A
    1-D or 2-D Tensor lr then takes the same paths as a 0-dim one (``value=`` of
    ``addcdiv_`` accepts only a 0-dim Tensor)."""
    return x.squeeze() if isinstance(x, Tensor) and x.dim() != 0 else x


def decay_grad(g: Tensor, w: Tensor, weight_decay: Any) -> Tensor:
    """``g + wd * w`` as torch's single-tensor paths: a Tensor decay that requires grad goes
    through ``addcmul_`` (``alpha=`` takes numbers only, so no gradient would reach it)."""
    if isinstance(weight_decay, Tensor) and weight_decay.requires_grad:
        return g.addcmul_(w.clone(), weight_decay)
    return g.add(w, alpha=weight_decay)
