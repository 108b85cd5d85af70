"""Muon that knows about delay: ``torch.optim.Muon`` for matrices, AdamW for the rest.

Why: Zmushko et al. (ICML 2026, "One-Step Gradient Delay is Not a Barrier for Large-Scale
Asynchronous Pipeline Parallel LLM Pretraining", arXiv 2606.30634) report Muon robust under
PipeDream-2BW's one-step delay where AdamW degrades. torch 2.13 ships ``torch.optim.Muon``
but it refuses parameters that are not 2-D, and a pipeline stage's optimizer is handed all
of its stage's parameters; so this optimizer runs torch's Muon update on every 2-D parameter
and AdamW (Keller Jordan's ``MuonWithAuxAdam`` defaults) on every other one, in one
optimizer. Over a flat arena bucket the Newton-Schulz iteration runs on each parameter's
view of the flat buffers: no weight is copied.

Of the engine's delay options Muon takes ``prediction="linear"`` (w_hat = w - H * s, s the
last applied step; for Muon this is also the no-new-gradient extrapolation, see
docs/ALGORITHMS.md) and PipeMare's discrepancy correction. Spike compensation and the
``"momentum"`` prediction are refused: the orthogonalisation is not linear in the momentum,
so the per-gradient argument behind SC_D does not carry over. Zmushko et al.'s
error-feedback correction is not implemented: no source available to this project gives its
exact update (docs/ALGORITHMS.md says what is known).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from engine.optim import functional_muon as fm
from engine.optim.base import DELAY_DEFAULTS, DelayOptimizer
from engine.optim.flat import FlatBinding
from engine.optim.options import DelayOptions, is_real_number, scalar, takes_delay_options

__all__ = ["Muon"]

#: defaults of the AdamW part: Keller Jordan's MuonWithAuxAdam (github.com/KellerJordan/Muon)
ADAMW_DEFAULTS: dict[str, Any] = {
    "adamw_lr": 3e-4,
    "adamw_betas": (0.9, 0.95),
    "adamw_eps": 1e-10,
    "adamw_weight_decay": 0.0,
}


#: the delay option Muon lacks (delay compensation's derivation does not cover the
#: orthogonalisation after momentum, docs/ALGORITHMS.md "Muon under delay")
_NO_DELAY_COMPENSATION = ("delay_compensation",)


class Muon(DelayOptimizer):
    """Muon (torch.optim.Muon's form) on 2-D params, AdamW on the others, plus delay options.

    With ``delay=0`` and the delay options off the 2-D params equal ``torch.optim.Muon`` and
    the others ``torch.optim.AdamW(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
    weight_decay=adamw_weight_decay)`` bit for bit on CPU. A param group with
    ``use_muon=False`` gives every tensor AdamW (embeddings, the LM head: Keller Jordan's
    recommendation). ``adamw_lr=None`` uses the group's
    ``lr`` for the AdamW part too (Moonlight's setting, meant with
    ``adjust_lr_fn="match_rms_adamw"``); a scheduler that changes ``lr`` then drives both.
    PipeMareLR's ``lr_scale`` multiplies both learning rates. ``maximize`` ascends.
    There is no fused kernel (the matrix work is torch's GEMMs): ``fused=True`` is refused.
    """

    _family = "muon"
    _direction_key = "last_update"
    #: the flat bucket being stepped (set around the base class's flat step), else None
    _layout: FlatBinding | None = None

    @takes_delay_options(without=_NO_DELAY_COMPENSATION)
    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = fm.NS_COEFFICIENTS,
        eps: float = fm.EPS,
        ns_steps: int = fm.NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        use_muon: bool = True,
        adamw_lr: float | None = ADAMW_DEFAULTS["adamw_lr"],
        adamw_betas: tuple[float, float] = ADAMW_DEFAULTS["adamw_betas"],
        adamw_eps: float = ADAMW_DEFAULTS["adamw_eps"],
        adamw_weight_decay: float = ADAMW_DEFAULTS["adamw_weight_decay"],
        maximize: bool = False,
        fused: bool | None = None,
        delay_options: DelayOptions,
    ) -> None:
        if isinstance(ns_coefficients, list):
            ns_coefficients = tuple(ns_coefficients)
        if isinstance(adamw_betas, list):
            adamw_betas = tuple(adamw_betas)
        defaults = {
            **DELAY_DEFAULTS,
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "use_muon": use_muon,
            "adamw_lr": adamw_lr,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
            "maximize": maximize,
            # the base class's torch flags; Muon has no differentiable or foreach path
            "foreach": None,
            "differentiable": False,
            **delay_options.group(without=_NO_DELAY_COMPENSATION),
            "fused": fused,
        }
        DelayOptimizer.__init__(self, params, defaults)

    # ------------------------------------------------------------------ options

    def _check_options(self, group: dict[str, Any], where: str) -> None:
        super()._check_options(group, where)
        name = type(self).__name__
        if group["spike_compensation"]:
            raise ValueError(
                f"{where}spike_compensation=True is not available for {name}: the "
                "orthogonalisation is not linear in the momentum, so SC_D's per-gradient "
                "argument does not hold (nesterov=True is Muon's look-ahead); use "
                "prediction='linear', or engine.optim.SGD/Adam for spike compensation"
            )
        if group["prediction"] == "momentum":
            raise ValueError(
                f"{where}prediction='momentum' is not available for {name}: without new "
                "gradients its orthogonalised step stays the same, so use prediction='linear'"
            )
        for flag in ("fused", "differentiable"):
            if group[flag]:
                raise ValueError(
                    f"{where}{flag}=True is not available for {name} (no fused kernel and no "
                    f"differentiable path: the matrix update runs torch ops); pass {flag}="
                    f"{'None' if flag == 'fused' else 'False'}"
                )
        for key in ("momentum", "eps", "adamw_eps", "adamw_weight_decay"):
            value = group[key]
            if not (is_real_number(value) and value >= 0.0):
                raise ValueError(f"{where}{key}={value!r} is invalid: it must be a float >= 0")
        adamw_lr = group["adamw_lr"]
        if adamw_lr is not None and not (is_real_number(adamw_lr) and adamw_lr >= 0.0):
            raise ValueError(
                f"{where}adamw_lr={adamw_lr!r} is invalid: a float >= 0, or None (the group's lr)"
            )
        for flag in ("nesterov", "use_muon"):
            if not isinstance(group[flag], bool):
                raise TypeError(f"{where}{flag}={group[flag]!r} is invalid: it must be True or False")
        coeffs = group["ns_coefficients"]
        if not (isinstance(coeffs, tuple) and len(coeffs) == 3 and all(map(is_real_number, coeffs))):
            raise ValueError(
                f"{where}ns_coefficients={coeffs!r} is invalid: give three floats (a, b, c)"
            )
        steps = group["ns_steps"]
        if not (isinstance(steps, int) and not isinstance(steps, bool) and 0 <= steps < 100):
            raise ValueError(
                f"{where}ns_steps={steps!r} is invalid: an int in [0, 100) (as torch.optim.Muon)"
            )
        fn = group["adjust_lr_fn"]
        if fn is not None and fn not in fm.ADJUST_LR_FNS:
            raise ValueError(
                f"{where}adjust_lr_fn={fn!r} is not supported; use None, "
                + " or ".join(repr(f) for f in fm.ADJUST_LR_FNS)
            )
        betas = group["adamw_betas"]
        if not (isinstance(betas, tuple) and len(betas) == 2 and all(map(is_real_number, betas))
                and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(
                f"{where}adamw_betas={betas!r} is invalid: give (beta1, beta2), each in [0, 1)"
            )

    def _check_group(self, group: dict[str, Any], index: int, stepping: bool = True) -> None:
        super()._check_group(group, index, stepping)
        for j, p in enumerate(group["params"]):
            if torch.is_complex(p):
                raise TypeError(
                    f"param_groups[{index}]: params[{j}] is {p.dtype}; {type(self).__name__} "
                    "does not support complex parameters (as torch.optim.Muon)"
                )

    # ------------------------------------------------------------------ state

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        """The elementwise (flat-able) state: the delay buffers. Muon's and AdamW's own state
        is per parameter (:meth:`_part_state`), in torch's keys."""
        keys = ["last_update"] if group["prediction"] is not None else []
        if self._correction_gamma(group) is not None:
            keys.append("delta")
        return keys

    def _is_fresh(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        # each part creates its own state in the update, so a flat bucket mixing fresh and
        # stepped params is stepped whole: never report "fresh" to the flat path's check
        return False

    def _ensure_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> bool:
        fresh = not state
        self._part_state(group, p, state)
        for key in self._state_keys(group):
            if key not in state:
                state[key] = self._new_state_tensor(p)
        return fresh

    def _part_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """torch.optim.Muon's ``momentum_buffer`` for a matrix Muon updates (2-D, in a group
        with ``use_muon``), torch.optim.AdamW's ``step``/``exp_avg``/``exp_avg_sq`` otherwise
        (created when missing)."""
        if group["use_muon"] and p.dim() == 2:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = self._new_state_tensor(p)
        elif "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = self._new_state_tensor(p)
            state["exp_avg_sq"] = self._new_state_tensor(p)
        return state

    # ------------------------------------------------------------------ update

    def _fused_choice(self, index: int, group: dict[str, Any], params: list[Tensor]) -> bool:
        return False  # no fused kernel: the reference path on every device

    def _flat_step(self, group: dict[str, Any], b: FlatBinding, *args: Any) -> bool:
        # remember the bucket's layout for _call_update, which gets its flat buffers only
        self._layout = b
        try:
            return super()._flat_step(group, b, *args)
        finally:
            self._layout = None

    def _parts(self, group: dict[str, Any], param: Tensor, grad: Tensor) -> list[fm.Part]:
        """(param view, grad view, state) of every tensor ``param`` holds."""
        b = self._layout
        if b is None:  # one tensor (the per-tensor path passes the param itself)
            return [(param, grad, self._part_state(group, param, self.state[param]))]
        v = b.view
        return [
            (param[o : o + n].view(shape), grad[o : o + n].view(shape),
             self._part_state(group, p, self.state[p]))
            for p, o, n, shape in zip(b.params, v.offsets, v.numels, v.shapes, strict=True)
        ]

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
        lr = group["lr"]
        if not (isinstance(lr, Tensor) and "lr_scale" not in group):
            lr = self.effective_lr(group)  # a Tensor lr stays one, as in torch (its rounding)
        adamw_lr = group["adamw_lr"]
        if adamw_lr is None:
            adamw_lr = lr
        elif "lr_scale" in group:
            adamw_lr = adamw_lr * group["lr_scale"]
        gamma = self._correction_gamma(group)
        fn(
            param,
            grad,
            self._parts(group, param, grad),
            lr=lr,
            weight_decay=scalar(group["weight_decay"]),
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            ns_coefficients=group["ns_coefficients"],
            ns_steps=group["ns_steps"],
            eps=group["eps"],
            adjust_lr_fn=group["adjust_lr_fn"],
            use_muon=group["use_muon"],
            adamw_lr=adamw_lr,
            adamw_betas=group["adamw_betas"],
            adamw_eps=group["adamw_eps"],
            adamw_weight_decay=group["adamw_weight_decay"],
            maximize=group["maximize"],
            last_update=state.get("last_update"),
            predicted=predicted,
            predict_horizon=float(self._horizon(group)) if predicted is not None else 0.0,
            delta=state.get("delta") if gamma is not None else None,
            delta_gamma=gamma if gamma is not None else 0.0,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )

    def _prediction_coeff(self, group: dict[str, Any], horizon: float) -> float:
        return float(horizon)  # "linear" only (momentum refused above)
