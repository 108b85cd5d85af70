"""Options every engine optimizer understands, their defaults, and their validation.

Why per param group: the pipeline sets each stage's delay D_s on its optimizer's groups, and
a user may give groups their own lr or weight decay, so the delay options
(:class:`engine.mitigations.DelayOptions`: their one list, defaults and checks) are group
defaults like ``lr``. Every check names the option, its value and the group, and runs before
anything changes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from engine.mitigations import PREDICTION_MODES, DelayOptions, is_real_number

__all__ = [
    "DELAY_DEFAULTS",
    "PREDICTION_MODES",
    "DelayOptions",
    "check_delay_options",
    "check_state_dtype",
    "check_torch_flags",
    "is_real_number",
    "scalar",
    "takes_delay_options",
]

#: the delay options every engine optimizer's groups hold, with their defaults (Muon has no
#: ``delay_compensation``, so it is not among them), and torch's ``fused``
DELAY_DEFAULTS: dict[str, Any] = {**DelayOptions().group(without=("delay_compensation",)),
                                  "fused": None}

_Init = TypeVar("_Init", bound=Callable[..., None])


def takes_delay_options(without: tuple[str, ...] = ()) -> Callable[[_Init], _Init]:
    """Give an optimizer's ``__init__(self, ..., delay_options: DelayOptions)`` the keywords of
    :class:`DelayOptions` (keyword-only, with their defaults; ``without``: those it lacks): a
    caller passes ``delay=3, prediction="linear"``, the constructor receives one
    ``DelayOptions``, and ``inspect.signature`` (``help``) lists the keywords in its place."""
    names = [f for f in dataclasses.fields(DelayOptions) if f.name not in without]

    def wrap(init: _Init) -> _Init:
        sig = inspect.signature(init)
        own = [p for p in sig.parameters.values() if p.name != "delay_options"]
        keywords = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                      annotation=f.type) for f in names]

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            given = {f.name: kwargs.pop(f.name) for f in names if f.name in kwargs}
            init(self, *args, delay_options=DelayOptions(**given), **kwargs)

        __init__.__signature__ = sig.replace(parameters=[*own, *keywords])  # type: ignore[attr-defined]
        return __init__  # type: ignore[return-value]

    return wrap


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
    DelayOptions.check(group, where)
    check_state_dtype(group, where)
    check_torch_flags(group, where)
    for name in ("maximize", "spike_compensation", "discrepancy_correction"):
        if not isinstance(group[name], bool):
            raise TypeError(f"{where}{name}={group[name]!r} is invalid: it must be True or False")


#: values of the ``state_dtype`` option (SGD, Adam, AdamW): None and torch.float32 are the
#: default (fp32 moments for bf16/fp16 params), "param" / a low-precision dtype keep the
#: moments of params of that dtype in it (torch fused's layout)
STATE_DTYPES: tuple[Any, ...] = (None, torch.float32, torch.bfloat16, torch.float16, "param")


def check_state_dtype(group: dict[str, Any], where: str) -> None:
    """``state_dtype`` (absent: None, the default). Refused with autograd through the step:
    a differentiable step keeps the reference's exact op order, which holds fp32 moments."""
    choice = group.get("state_dtype")
    if choice is None:
        return
    if not any(choice is v or (isinstance(choice, str) and choice == v) for v in STATE_DTYPES):
        raise ValueError(
            f"{where}state_dtype={choice!r} is invalid: use None or torch.float32 (fp32 "
            "moments, the default), torch.bfloat16 or torch.float16 (the moments of params of "
            "that dtype kept in it) or 'param' (every param's moments in its own dtype)"
        )
    if choice is not torch.float32 and group.get("differentiable"):
        raise ValueError(
            f"{where}state_dtype={choice!r} cannot be combined with differentiable=True: "
            "autograd through step() runs the reference op for op on fp32 moments; use "
            "state_dtype=None there"
        )
