"""What a param group's learning rate is at a step: a number, or a device tensor the fused
kernels load.

Why a device tensor: a fused kernel that takes lr as a launch argument bakes the value into
the launch, so a CUDA graph that replays it keeps the old value and an LR schedule forces a
recapture per value. torch's convention for capturable/fused optimizers is the answer: a
Tensor ``lr`` stays a tensor, and torch's LR schedulers write such an lr in place
(``fill_``), so its address never changes. Here a group's lr is read on the device when it
is one float32 element on the params' device and the fused path runs; the scalars derived
from it are computed on the device with the host's arithmetic
(``engine.update_rules.lr_product``), so the result is bitwise that of the same value given
as a number. Everything else (the reference path, a legacy ``lr_scale``, another dtype or
device) reads it as a number, as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["for_launch", "number", "on_device", "record_for_prediction"]


def number(group: dict[str, Any]) -> float:
    """The learning rate the group's next update uses: ``lr`` (times a legacy ``lr_scale``
    where an old checkpoint carries one). Without it the lr is used untouched (no
    multiplication at all: bit-identical to torch.optim). A Tensor lr is read on the host."""
    lr = group["lr"]
    lr = float(lr.detach()) if isinstance(lr, Tensor) else lr  # (no autograd warning)
    if "lr_scale" in group:
        return lr * group["lr_scale"]
    return lr


def on_device(group: dict[str, Any], device: torch.device | None) -> Tensor | None:
    """The group's lr as the fused kernels load it on ``device``, or None when they take a
    number (:func:`number`)."""
    lr = group["lr"]
    if (isinstance(lr, Tensor) and device is not None and "lr_scale" not in group
            and lr.numel() == 1 and lr.dtype == torch.float32 and lr.device == device):
        return lr
    return None


def for_launch(group: dict[str, Any], device: torch.device) -> float | Tensor:
    """The ``lr`` argument of a fused launch on ``device``."""
    lr = on_device(group, device)
    return number(group) if lr is None else lr


def record_for_prediction(group: dict[str, Any], device: torch.device | None) -> None:
    """``group["prediction_lr"]``, the lr later predictions extrapolate with: a number, or,
    where the kernels read a device lr (``device``: the fused launch's), a device copy
    updated in place: no host read, and one address from step to step, as a captured step
    needs. (Recomputing a prediction later, on demand, reads it on the host.)"""
    lr = on_device(group, device)
    if lr is None:
        group["prediction_lr"] = number(group)
        return
    kept = group.get("prediction_lr")
    if (isinstance(kept, Tensor) and kept.shape == lr.shape and kept.device == lr.device
            and kept.dtype == lr.dtype):
        kept.copy_(lr.detach())
    else:
        group["prediction_lr"] = lr.detach().clone()
