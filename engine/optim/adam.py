"""Adam and AdamW that know about delay: drop-ins for ``torch.optim.Adam`` / ``AdamW``.

Delay compensation for Adam is this project's own derivation (ALGORITHMS.md, "Adam / AdamW
with delay compensation"), not a published method:

* Spike compensation SC_D replaces the first moment in the numerator by
  ``b1^D * u_hat + (1 - b1^D) * g`` (D = 1 is NAdam's numerator with constant momentum).
* Prediction extrapolates the last applied step ``s = w_old - w_new`` (stored per param as
  ``state["last_update"]``, so it survives a state_dict round trip):
  ``"linear"``: w_hat = w - H * s, the rule of ALGORITHMS.md;
  ``"momentum"``: w_hat = w - (b1 + b1^2 + ... + b1^H) * s. Without new gradients Adam's first
  moment decays by b1 per step; holding the denominator (and bias corrections) fixed, the
  next H steps are b1*s, b1^2*s, ..., which is this sum. It is the Adam analogue of SGD's
  "momentum" mode and is exact for a constant denominator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from engine.optim import lr_values
from engine.optim.base import DELAY_DEFAULTS, DelayOptimizer, _functional
from engine.optim.options import DelayOptions, is_real_number, scalar, takes_delay_options

__all__ = ["Adam", "AdamW"]


class _AdamBase(DelayOptimizer):
    _family = "adam"
    _shared_scalars = (("step", 0.0),)

    def __init__(
        self,
        params: Any,
        lr: float | Tensor,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        amsgrad: bool,
        *,
        foreach: bool | None,
        maximize: bool,
        capturable: bool,
        differentiable: bool,
        fused: bool | None,
        decoupled_weight_decay: bool,
        delay_options: DelayOptions,
        state_dtype: torch.dtype | str | None = None,
    ) -> None:
        if isinstance(betas, list):
            betas = tuple(betas)
        defaults = {
            **DELAY_DEFAULTS,
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "decoupled_weight_decay": decoupled_weight_decay,
            **delay_options.group(),
            "fused": fused,
        }
        if self._family == "adam":  # NAdam keeps fp32 moments (no state_dtype option)
            defaults["state_dtype"] = state_dtype
        super().__init__(params, defaults)

    def _check_options(self, group: dict[str, Any], where: str) -> None:
        super()._check_options(group, where)
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"{where}betas={betas!r} is invalid: give a pair (beta1, beta2)")
        tensors = [isinstance(b, Tensor) for b in betas]
        if any(tensors) and not all(tensors):
            raise ValueError(
                f"{where}betas must be either both floats or both Tensors, got {betas!r} "
                "(as in torch.optim)"
            )
        no_tensor_options = group["foreach"] and not group["capturable"]
        if no_tensor_options and isinstance(group["lr"], Tensor):
            raise ValueError(
                f"{where}lr as a Tensor is not supported for capturable=False and foreach=True"
            )
        for i, b in enumerate(betas):
            if isinstance(b, Tensor):
                if no_tensor_options:
                    raise ValueError(
                        f"{where}betas[{i}] as a Tensor is not supported for capturable=False "
                        "and foreach=True"
                    )
                if b.numel() != 1:
                    raise ValueError(f"{where}Tensor betas[{i}] must be 1-element")
                value = float(b.detach())
            elif is_real_number(b):
                value = float(b)
            else:
                raise TypeError(f"{where}betas[{i}]={b!r} is invalid: it must be a float")
            if not 0.0 <= value < 1.0:
                raise ValueError(
                    f"{where}Invalid beta parameter at index {i}: {b!r} (each beta must lie "
                    "in [0, 1): beta = 1 never forgets and divides by zero in the bias correction)"
                )
        for name in ("capturable", "decoupled_weight_decay"):
            if not isinstance(group[name], bool):
                raise TypeError(f"{where}{name}={group[name]!r} is invalid: it must be True or False")
        eps = group["eps"]
        if not (is_real_number(eps) and eps >= 0.0):
            raise ValueError(f"{where}eps={eps!r} is invalid: it must be a float >= 0")
        if not isinstance(group.get("amsgrad", False), bool):  # NAdam has no amsgrad
            raise TypeError(f"{where}amsgrad={group['amsgrad']!r} is invalid: it must be True or False")

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        keys = ["exp_avg", "exp_avg_sq"]
        if group.get("amsgrad", False):  # (NAdam has no amsgrad)
            keys.append("max_exp_avg_sq")
        if group["prediction"] is not None:
            keys.append("last_update")
        if self._delta_gamma(group) is not None:
            keys.append("delta")
        return keys

    def _is_fresh(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        return "step" not in state

    def _ensure_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> bool:
        fresh = self._is_fresh(group, state)
        if fresh:
            # torch keeps the (non-fused) step count on the CPU; we keep it beside the param
            # so the fused kernels read it without a host sync (identical on CPU).
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for key in self._state_keys(group):
            if key not in state:
                state[key] = self._new_state_tensor(p, group, key)
        return fresh

    def _call_update(
        self,
        fn: Callable[..., Any],
        group: dict[str, Any],
        param: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        init: bool,
        predicted: Tensor | None,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        reference = fn is self._paths.reference
        # the reference path takes Tensor lr/betas as torch does (its rounding follows them);
        # the kernels read Python numbers (lr: a device tensor where they can load it)
        beta1, beta2 = group["betas"] if reference else (scalar(b) for b in group["betas"])
        lr = group["lr"]
        if not reference:  # a device lr where the kernels can load it (lr_values.on_device)
            lr = lr_values.for_launch(group, param.device)
        elif not (isinstance(lr, Tensor) and "lr_scale" not in group):
            lr = self.effective_lr(group)
        gamma = self._delta_gamma(group)
        horizon = 0.0
        if predicted is not None:
            horizon = self._adam_horizon(group, self._horizon(group))
        fn(
            param,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            state.get("max_exp_avg_sq"),
            step=state["step"],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            # autograd through a differentiable step reaches a Tensor decay, as in torch
            weight_decay=group["weight_decay"] if reference and group["differentiable"]
            else scalar(group["weight_decay"]),
            decoupled=group["decoupled_weight_decay"],
            amsgrad=group["amsgrad"],
            maximize=group["maximize"],
            sc_delay=group["delay"] if group["spike_compensation"] else 0,
            last_update=state.get("last_update"),
            predicted=predicted,
            predict_horizon=horizon,
            delta=state.get("delta") if gamma is not None else None,
            delta_gamma=gamma if gamma is not None else 0.0,
            dc_coeff=self._dc_coeff(group),
            grad_scale=grad_scale,
            found_inf=found_inf,
            validate=False,
            # the reference path's flags; the fused kernel never syncs and is not differentiable
            **(
                {"capturable": group["capturable"], "differentiable": group["differentiable"]}
                if reference else {}
            ),
        )

    @staticmethod
    def _adam_horizon(group: dict[str, Any], horizon: float) -> float:
        """Multiple of the last step that the prediction extrapolates (module docstring)."""
        if group["prediction"] == "linear":
            return float(horizon)
        return _functional().prediction_coeff("momentum", 1.0, scalar(group["betas"][0]), horizon)

    _direction_key = "last_update"

    def _prediction_coeff(self, group: dict[str, Any], horizon: float) -> float:
        return self._adam_horizon(group, horizon)


class Adam(_AdamBase):
    """Adam with L2 weight decay (added to the gradient; ``decoupled_weight_decay=True``
    makes it AdamW, as in torch), plus the delay options.

    With ``delay=0`` and the mitigations off the result equals ``torch.optim.Adam`` bit for bit
    on CPU. See the module docstring for what spike compensation and prediction mean for Adam,
    and ``engine.optim.SGD`` for the shared delay keywords. torch's keywords keep torch's
    meaning: ``capturable=True`` computes the bias corrections from the step tensor without a
    host read (also on CPU, where torch refuses it), ``differentiable=True`` lets autograd go
    through ``step()``, ``foreach`` never changes a result. ``state_dtype`` (``None``,
    ``torch.float32``, ``torch.bfloat16``, ``torch.float16`` or ``"param"``, as for
    ``engine.optim.SGD``) keeps exp_avg / exp_avg_sq (/ max_exp_avg_sq) of bf16/fp16 params in
    their own dtype, torch fused's layout (14 B/param per bf16 step instead of 22).
    """

    @takes_delay_options()
    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        state_dtype: torch.dtype | str | None = None,
        delay_options: DelayOptions,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
            capturable=capturable, differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay, delay_options=delay_options,
            state_dtype=state_dtype,
        )


class AdamW(_AdamBase):
    """AdamW: Adam with decoupled weight decay (w *= 1 - lr * wd), torch's default wd=1e-2.

    With ``delay=0`` and the mitigations off the result equals ``torch.optim.AdamW`` bit for
    bit on CPU. Prediction extrapolates the whole applied step, decay included.
    """

    @takes_delay_options()
    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        state_dtype: torch.dtype | str | None = None,
        delay_options: DelayOptions,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
            capturable=capturable, differentiable=differentiable, fused=fused,
            decoupled_weight_decay=True, delay_options=delay_options, state_dtype=state_dtype,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        # as torch.optim.AdamW: whatever state is loaded (an Adam state_dict included),
        # AdamW's weight decay stays decoupled
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
