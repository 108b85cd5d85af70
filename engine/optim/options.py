"""Options every engine optimizer understands, their defaults, and their validation.

Why per param group: the pipeline sets each stage's delay D_s on its optimizer's groups, and
a user may give groups their own lr or weight decay, so the delay-related options
(``delay``, ``spike_compensation``, ``prediction``, ``prediction_horizon``,
``discrepancy_correction``, ``correction_decay``, ``delay_compensation``) are group defaults
like ``lr``. Every check names the option, its value and the group, and runs before anything
changes.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from torch import Tensor

__all__ = [
    "DELAY_DEFAULTS",
    "PREDICTION_MODES",
    "check_delay_compensation",
    "check_delay_options",
    "check_torch_flags",
    "is_real_number",
    "scalar",
]

#: Valid values of the ``prediction`` option (public API, see ALGORITHMS.md).
PREDICTION_MODES: tuple[str, ...] = ("linear", "momentum")

# Options every engine optimizer understands, with their defaults.
DELAY_DEFAULTS: dict[str, Any] = {
    "delay": 0,
    "spike_compensation": False,
    "prediction": None,
    "prediction_horizon": None,
    "discrepancy_correction": False,
    "correction_decay": 0.1,
    "fused": None,
}


def is_real_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def scalar(x: Any) -> Any:
    """A number option as a Python number (a 1-element tensor is read once, on the host)."""
    return float(x.detach()) if isinstance(x, Tensor) else x


def _number_or_tensor(name: str, x: Any, where: str) -> float:
    """The value of an option torch accepts as a number or a 1-element tensor."""
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError(
                f"{where}Tensor {name} must be 1-element, got shape {tuple(x.shape)}"
            )
        return float(x.detach())
    if is_real_number(x):
        return float(x)
    raise TypeError(f"{where}{name} must be a number or a 1-element tensor, got {type(x).__name__} {x!r}")


def check_torch_flags(group: dict[str, Any], where: str) -> None:
    """torch.optim's implementation flags: ``foreach`` and ``fused`` (None, True or False),
    ``differentiable`` (bool), and the combinations torch refuses."""
    for name in ("foreach", "fused"):
        if group.get(name) not in (None, True, False):
            raise ValueError(f"{where}{name}={group[name]!r} is invalid: use None (auto), True or False")
    if not isinstance(group.get("differentiable", False), bool):
        raise TypeError(f"{where}differentiable={group['differentiable']!r} is invalid: it must be True or False")
    if group.get("fused") and group.get("differentiable"):
        raise RuntimeError(f"{where}`fused` does not support `differentiable` (as in torch.optim)")
    if group.get("fused") and group.get("foreach"):
        raise RuntimeError(f"{where}`fused` and `foreach` cannot be `True` together (as in torch.optim)")


def check_delay_options(group: dict[str, Any], where: str) -> None:
    """Raise a ValueError naming the option, its value and ``where`` (the group) if any
    option of ``group`` is out of range. Subclasses extend it with their own options."""
    lr_value = _number_or_tensor("lr", group["lr"], where)
    if not lr_value >= 0.0:
        raise ValueError(f"{where}Invalid learning rate: {group['lr']!r} (the learning rate must be >= 0)")
    scale = group.get("lr_scale", 1.0)
    if not (is_real_number(scale) and scale >= 0.0):
        raise ValueError(f"{where}lr_scale={scale!r} is invalid: it must be a float >= 0 (PipeMareLR sets it)")
    if not _number_or_tensor("weight_decay", group["weight_decay"], where) >= 0.0:
        raise ValueError(
            f"{where}Invalid weight_decay value: {group['weight_decay']!r} (it must be >= 0)"
        )
    delay = group["delay"]
    if not isinstance(delay, numbers.Integral) or isinstance(delay, bool):
        raise TypeError(
            f"{where}delay={delay!r} is invalid: the delay is a whole number of updates (an int >= 0)"
        )
    if delay < 0:
        raise ValueError(
            f"{where}delay={delay!r} is invalid: the delay counts updates applied between a forward "
            "and the update of its gradient, so it must be >= 0"
        )
    mode = group["prediction"]
    if mode is not None and mode not in PREDICTION_MODES:
        raise ValueError(
            f"{where}prediction={mode!r} is not a prediction mode; valid values are None, "
            + ", ".join(repr(m) for m in PREDICTION_MODES)
        )
    horizon = group["prediction_horizon"]
    if horizon is not None and not (is_real_number(horizon) and horizon >= 0 and math.isfinite(horizon)):
        raise ValueError(
            f"{where}prediction_horizon={horizon!r} is invalid: use None (the group's delay) or a number >= 0"
        )
    if mode == "momentum" and horizon is not None and int(horizon) != horizon:
        raise ValueError(
            f"{where}prediction_horizon={horizon!r} is invalid for prediction='momentum': it "
            "sums m + m^2 + ... + m^H, so H must be a whole number (or use 'linear')"
        )
    decay = group["correction_decay"]
    if not (is_real_number(decay) and 0.0 < decay < 1.0):
        raise ValueError(
            f"{where}correction_decay={decay!r} is invalid: PipeMare's D_decay must lie in (0, 1) "
            "(gamma = D_decay ** (1 / delay))"
        )
    check_delay_compensation(group, where)
    check_torch_flags(group, where)
    for name in ("maximize", "spike_compensation", "discrepancy_correction"):
        if not isinstance(group[name], bool):
            raise TypeError(f"{where}{name}={group[name]!r} is invalid: it must be True or False")


def check_delay_compensation(group: dict[str, Any], where: str) -> None:
    """``delay_compensation`` (DC-ASGD's lambda, ALGORITHMS.md "Delay-compensated
    gradients"): a finite number >= 0; 0 (the default, also when absent) is off."""
    lam = group.get("delay_compensation", 0.0)
    if not (is_real_number(lam) and math.isfinite(lam) and lam >= 0.0):
        raise ValueError(
            f"{where}delay_compensation={lam!r} is invalid: it is DC-ASGD's lambda in "
            "g + lambda * g * g * (w_t - w_(t-tau)), a finite number >= 0 (0 turns it off)"
        )
