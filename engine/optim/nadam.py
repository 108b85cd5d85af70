"""NAdam that knows about delay: a drop-in for ``torch.optim.NAdam``, for asynchronous pipelines.

Why: Ajanthan et al. (ICML 2025, "Nesterov Method for Asynchronous Pipeline Parallel
Optimization", code PluralisResearch/AsyncPP) run torch's NAdam (beta1 = 0.99, momentum
decay 0.004, decoupled weight decay) over PipeDream weight stashing: Nesterov's look-ahead
numerator applies part of each gradient at once, which counters the staleness. Their
``--adaptive_momentum`` raises beta1 per stage with the weight versions it keeps; here that
is ``stage_beta1=(beta1_max, num_stages)`` with V_s - 1 = the group's delay D_s (exact under
stashing, where the pipeline sets D_s = V_s - 1). docs/ALGORITHMS.md has the formulas.

Of the engine's delay options NAdam takes prediction (``"linear"``: w - H * s, s the last
applied step) and PipeMare's discrepancy correction (``delta``). Spike compensation is
refused: NAdam's numerator already is the look-ahead that SC_1 gives Adam, and no source
defines SC_D on top of it; ``prediction="momentum"`` is refused for the same reason (its
sum of beta1 powers is exact for Adam's constant momentum, not for NAdam's schedule).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from engine.optim.adam import _AdamBase
from engine.optim import lr_values
from engine.optim.base import DELAY_DEFAULTS, DelayOptimizer
from engine.optim.functional_nadam import stage_beta1
from engine.optim.options import DelayOptions, is_real_number, scalar, takes_delay_options

__all__ = ["NAdam"]


class NAdam(_AdamBase):
    """NAdam (Dozat 2016, torch.optim.NAdam's form) plus the delay options.

    With ``delay=0`` and the delay options off the result equals ``torch.optim.NAdam`` bit
    for bit on CPU (``foreach``, ``capturable``, ``differentiable`` keep torch's meaning).
    ``decoupled_weight_decay=True`` is NAdamW (AsyncPP's setting). ``stage_beta1=(b_max, S)``
    uses beta1_s = beta1 + D_s * (b_max - beta1) / S in place of ``betas[0]`` (AsyncPP's
    per-stage rule, D_s the group's delay, S the number of stages); ``None`` keeps beta1.
    """

    _family = "nadam"
    _shared_scalars = (("step", 0.0), ("mu_product", 1.0))

    @takes_delay_options()
    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 2e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        momentum_decay: float = 4e-3,
        decoupled_weight_decay: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        stage_beta1: tuple[float, int] | None = None,
        delay_options: DelayOptions,
    ) -> None:
        if isinstance(betas, list):
            betas = tuple(betas)
        if isinstance(stage_beta1, list):
            stage_beta1 = tuple(stage_beta1)
        defaults = {
            **DELAY_DEFAULTS,
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum_decay": momentum_decay,
            "decoupled_weight_decay": decoupled_weight_decay,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            **delay_options.group(),
            "stage_beta1": stage_beta1,
            "fused": fused,
        }
        DelayOptimizer.__init__(self, params, defaults)

    def _check_options(self, group: dict[str, Any], where: str) -> None:
        super()._check_options(group, where)
        if any(isinstance(b, Tensor) for b in group["betas"]):
            raise TypeError(f"{where}NAdam takes betas as floats, got {group['betas']!r}")
        decay = group["momentum_decay"]
        if not (is_real_number(decay) and decay >= 0.0):
            raise ValueError(f"{where}Invalid momentum_decay value: {decay!r} (it must be a float >= 0)")
        if group["spike_compensation"]:
            raise ValueError(
                f"{where}spike_compensation=True is not available for NAdam: its numerator is "
                "already the Nesterov look-ahead (Adam's SC_1); use engine.optim.Adam with "
                "spike_compensation, or NAdam without it"
            )
        if group["prediction"] == "momentum":
            raise ValueError(
                f"{where}prediction='momentum' is not available for NAdam (its beta1 sum assumes "
                "Adam's constant momentum); use prediction='linear'"
            )
        rule = group["stage_beta1"]
        if rule is None:
            return
        if not (isinstance(rule, tuple) and len(rule) == 2 and is_real_number(rule[0])
                and isinstance(rule[1], int) and not isinstance(rule[1], bool)):
            raise TypeError(
                f"{where}stage_beta1={rule!r} is invalid: give (beta1_max, num_stages), e.g. "
                "(0.99, 8), or None"
            )
        beta1_max, stages = rule
        if not 0.0 <= beta1_max < 1.0 or stages < 1:
            raise ValueError(
                f"{where}stage_beta1={rule!r} is invalid: beta1_max must lie in [0, 1) and "
                "num_stages be >= 1"
            )
        value = self._beta1(group)
        if not 0.0 <= value < 1.0:
            raise ValueError(
                f"{where}stage_beta1={rule!r} with delay={group['delay']} gives beta1={value!r}, "
                "outside [0, 1): the rule assumes delay <= num_stages - 1 (PipeDream stashing)"
            )

    @staticmethod
    def _beta1(group: dict[str, Any]) -> float:
        """The group's beta1: ``betas[0]``, or AsyncPP's per-stage value (module docstring)."""
        beta1 = scalar(group["betas"][0])
        rule = group.get("stage_beta1")
        if rule is None:
            return beta1
        return stage_beta1(beta1, rule[0], rule[1], group["delay"])

    def _ensure_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> bool:
        fresh = super()._ensure_state(group, p, state)
        if "mu_product" not in state:
            # torch keeps it on the CPU (non-capturable); beside the param, as Adam's step
            state["mu_product"] = torch.ones((), dtype=torch.float32, device=p.device)
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
        gamma = self._delta_gamma(group)
        # the reference path takes a Tensor lr as torch does (its rounding follows it)
        lr = group["lr"]
        if not reference:  # a device lr where the kernels can load it (lr_values.on_device)
            lr = lr_values.for_launch(group, param.device)
        elif not (isinstance(lr, Tensor) and "lr_scale" not in group):
            lr = self.effective_lr(group)
        fn(
            param,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            state["mu_product"],
            step=state["step"],
            lr=lr,
            beta1=self._beta1(group),
            beta2=scalar(group["betas"][1]),
            eps=group["eps"],
            weight_decay=scalar(group["weight_decay"]),
            momentum_decay=group["momentum_decay"],
            decoupled=group["decoupled_weight_decay"],
            maximize=group["maximize"],
            last_update=state.get("last_update"),
            predicted=predicted,
            predict_horizon=float(self._horizon(group)) if predicted is not None else 0.0,
            delta=state.get("delta") if gamma is not None else None,
            delta_gamma=gamma if gamma is not None else 0.0,
            dc_coeff=self._dc_coeff(group),
            grad_scale=grad_scale,
            found_inf=found_inf,
            validate=False,
            **(
                {"capturable": group["capturable"], "differentiable": group["differentiable"]}
                if reference else {}
            ),
        )

    def _prediction_coeff(self, group: dict[str, Any], horizon: float) -> float:
        return float(horizon)  # "linear" only (momentum refused above)
