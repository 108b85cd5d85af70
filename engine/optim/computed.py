"""Weights computed from an optimizer's state: predictions and PipeMare's corrected weights.

Why here and not in the update functions only: a pipeline forward may need the prediction at
another horizon than the step wrote (SpecTrain's backward, a flush, a resumed run), and
PipeMare's backward reads w - tau * delta. These are cheap elementwise passes over the weights
and one state buffer; for flat-bound buckets they write straight into a buffer the caller
owns (the runtime's transient slot), for other tensors they return new tensors.

The formulas are ALGORITHMS.md's: ``w_hat = w - c * direction`` with the family's direction
(SGD's momentum buffer, Adam's last applied step) and coefficient (see each family's
``_prediction_coeff``), and ``w - tau_s * delta``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from engine.optim import functional
from engine.optim.options import is_real_number

__all__ = ["ComputedWeights"]


class ComputedWeights:
    """Mixin of :class:`~engine.optim.base.DelayOptimizer` (uses its groups, state, bindings)."""

    param_groups: list[dict[str, Any]]
    state: Any
    _predicted: dict[Tensor, Tensor]
    _predicted_setting: dict[Tensor, tuple[Any, ...]]
    _bind_order: list[Any]
    _direction_key: str = ""

    # provided by DelayOptimizer and the families
    def _horizon(self, group: dict[str, Any]) -> float: ...  # pragma: no cover
    def _correction_gamma(self, group: dict[str, Any]) -> float | None: ...  # pragma: no cover
    def _prediction_coeff(self, group: dict[str, Any], horizon: float) -> float | Tensor: ...  # pragma: no cover

    def _prediction_direction_and_coeff(
        self, group: dict[str, Any], p: Tensor, horizon: float
    ) -> tuple[Tensor | None, float | Tensor]:
        """Direction and coefficient with w_hat = w - coeff * direction (None: no direction yet)."""
        direction = self.state[p].get(self._direction_key) if p in self.state else None
        return direction, self._prediction_coeff(group, horizon)

    def _flat_state_of(self, group: dict[str, Any], b: Any, key: str) -> Tensor | None:
        """The binding's flat ``key`` state; rebuilt from the per-param state (after
        load_state_dict) when every param has one, else None (no such state yet)."""
        flat = b.state.get(key)
        if flat is None and all(key in self.state.get(p, {}) for p in b.params):
            flat = self._binding_state(group, b).get(key)
        return flat

    def _flat_direction_and_coeff(
        self, group: dict[str, Any], b: Any, horizon: float
    ) -> tuple[Tensor | None, float | Tensor]:
        direction = self._flat_state_of(group, b, self._direction_key)
        return direction, self._prediction_coeff(group, horizon)

    def _predicted_buffer(self, group: dict[str, Any], p: Tensor, like: Tensor) -> Tensor | None:
        """The buffer the update writes w_hat into (default horizon), or None."""
        if group["prediction"] is None:
            self._predicted.pop(p, None)
            return None
        buf = self._predicted.get(p)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty_like(like, memory_format=torch.contiguous_format)
            self._predicted[p] = buf
        self._predicted_setting[p] = (group["prediction"], self._horizon(group))
        return buf

    # ------------------------------------------------------------------ predicted / backward

    def predicted_weights(self, horizon: float | None = None) -> list[Tensor]:
        """w_hat for every parameter that requires grad, in param_groups order.

        With ``horizon=None`` each group uses its default horizon (``prediction_horizon``, else
        its delay) and the values come from the buffers the last step() wrote (the update
        kernel computes them in the same pass, with that step's lr); other horizons, or a
        changed group setting, are computed now from the stored direction with the same lr,
        the effective lr of the group's last step (``group["prediction_lr"]``). A group with ``prediction=None`` yields its live weights (w_hat =
        w). The tensors are owned by the optimizer and overwritten by the next step(): clone
        them to keep them.
        """
        if horizon is not None and not (is_real_number(horizon) and horizon >= 0):
            raise ValueError(f"horizon={horizon!r} is invalid: use None (each group's default) or a number >= 0")
        out: list[Tensor] = []
        for group in self.param_groups:
            mode = group["prediction"]
            h = self._horizon(group) if horizon is None else horizon
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if mode is None:
                    out.append(p.detach())
                    continue
                cached = self._predicted.get(p)
                if horizon is None and cached is not None and self._predicted_setting.get(p) == (mode, h):
                    out.append(cached)
                    continue
                direction, coeff = self._prediction_direction_and_coeff(group, p, h)
                if direction is None:
                    out.append(p.detach().clone())
                else:
                    out.append(functional.predict(p.detach(), direction, coeff))
        return out

    def predict_into(self, horizon: float | None, outs: Sequence[Tensor]) -> None:
        """Write w_hat of every bound flat buffer into ``outs`` (one flat tensor per binding,
        in the order given to :meth:`bind_flat`), with ``horizon`` (None: each group's
        default). Tensors without a direction yet (no step) predict their own weights."""
        if len(outs) != len(self._bind_order):
            raise ValueError(f"predict_into needs {len(self._bind_order)} outputs, got {len(outs)}")
        for (g, b), out in zip(self._bind_order, outs, strict=True):
            group = self.param_groups[g]
            h = self._horizon(group) if horizon is None else horizon
            w = b.view.param
            if group["prediction"] is None:
                out.copy_(w)
                continue
            direction, coeff = self._flat_direction_and_coeff(group, b, h)
            if direction is None:
                out.copy_(w)
            else:
                functional.predict_into(out, w, direction, coeff)

    def backward_weights_into(self, outs: Sequence[Tensor]) -> None:
        """Write PipeMare T2's w - tau_s * delta of every bound flat buffer into ``outs`` (one
        per binding, :meth:`bind_flat` order); live weights where the group keeps no delta."""
        if len(outs) != len(self._bind_order):
            raise ValueError(
                f"backward_weights_into needs {len(self._bind_order)} outputs, got {len(outs)}"
            )
        for (g, b), out in zip(self._bind_order, outs, strict=True):
            group = self.param_groups[g]
            w = b.view.param
            delta = self._flat_state_of(group, b, "delta")
            if self._correction_gamma(group) is None or delta is None:
                out.copy_(w)
            elif w.dtype == torch.float32:
                torch.add(w, delta, alpha=-group["delay"], out=out)
            else:
                out.copy_(torch.add(w.float(), delta, alpha=-group["delay"]))

    def backward_weights(self) -> list[Tensor]:
        """PipeMare T2's backward weights w - tau_s * delta for every parameter that requires
        grad, in param_groups order. Groups without correction (or with delay 0) yield their
        live weights (a detached view)."""
        out: list[Tensor] = []
        for group in self.param_groups:
            gamma = self._correction_gamma(group)
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                delta = self.state[p].get("delta") if p in self.state else None
                if gamma is None or delta is None:
                    out.append(p.detach())
                else:
                    # in delta's dtype (fp32, fp64 for fp64 params), rounded once to the param's
                    w = torch.add(functional._as_f32(p.detach()), delta, alpha=-group["delay"])
                    out.append(w if w.dtype == p.dtype else w.to(p.dtype))
        return out
