"""Momentum SGD that knows about delay: a drop-in for ``torch.optim.SGD``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from engine.optim import lr_values
from engine.optim.base import DELAY_DEFAULTS, DelayOptimizer, _functional
from engine.optim.options import DelayOptions, is_real_number, scalar, takes_delay_options
from engine.update_rules import lr_product

__all__ = ["SGD"]


class SGD(DelayOptimizer):
    """Momentum SGD in PyTorch's convention, plus the staleness mitigations of ALGORITHMS.md.

    With ``delay=0`` and the mitigations off the result equals ``torch.optim.SGD`` bit for bit
    on CPU (same op order, see ``engine.optim.functional.sgd_update``).

    Args (beyond torch's):
        delay: D_s, updates between a micro-batch's forward and the update of its gradient.
            The pipeline sets it per stage; per param group like every option.
        spike_compensation: apply SC_D (Kosson et al.) with D = ``delay``:
            ``w -= lr * (m^D * v + (1 - m^D) / (1 - m) * g')``. D = 1 is torch's Nesterov
            update exactly, so it cannot be combined with ``nesterov=True``.
        prediction: ``None``, ``"linear"`` (w_hat = w - lr*H*v) or ``"momentum"``
            (w_hat = w - lr*(m + ... + m^H)*v); read with :meth:`predicted_weights`.
        prediction_horizon: H; ``None`` means the group's delay.
        discrepancy_correction / correction_decay: PipeMare T2's delta buffer;
            :meth:`backward_weights` returns w - delay * delta.
        delay_compensation: DC-ASGD's lambda (0 = off): the gradient becomes
            g + lambda * g * g * (delay * delta) before anything else uses it, with PipeMare's
            delta (kept for it when discrepancy_correction is off) as the estimate of
            w_t - w_(t-delay). The project's own combination (ALGORITHMS.md).
        fused: ``None`` (Triton on CUDA, reference on CPU), ``True`` or ``False``.
        state_dtype: ``None`` (default; also ``torch.float32``): the momentum buffer is
            fp32 for bf16/fp16 params. ``torch.bfloat16`` / ``torch.float16``: params of that
            dtype keep it in that dtype, ``"param"``: every param in its own dtype (torch
            fused's layout: 10 B/param moved per bf16 step instead of 14). The math stays
            fp32; the stored buffer is rounded once per step (docs/ALGORITHMS.md, "Moments in
            the parameter dtype"). Not with ``differentiable=True``.

    On CPU, steps with spike compensation, prediction or PipeMare's delta run
    :mod:`engine.optim.cpu_loop` (one fused pass, bit-identical to the reference) on fp32
    contiguous tensors; ``PE_CPU_LOOP=0`` forces the reference. ``update_paths`` counts the
    update calls by path (``"cpu_loop"``, ``"reference"``, ``"triton"``).

    torch's keywords mean what they mean there: ``foreach`` picks an implementation and never
    changes a result (the flat path already updates a whole bucket in one call; with
    ``foreach`` set the per-tensor path runs as for ``foreach=None``); ``differentiable=True``
    runs the reference path per tensor with autograd on, so gradients flow through ``step()``.
    Sparse gradients (``nn.Embedding(sparse=True)``) take torch's sparse update; the delay
    mitigations, ``fused=True`` and AMP arguments are refused with them.
    """

    _family = "sgd"

    @takes_delay_options()
    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        state_dtype: torch.dtype | str | None = None,
        delay_options: DelayOptions,
    ) -> None:
        defaults = {
            **DELAY_DEFAULTS,
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            "foreach": foreach,
            "differentiable": differentiable,
            **delay_options.group(),
            "state_dtype": state_dtype,
            "fused": fused,
        }
        #: update calls (one per flat buffer or tensor) by the path that ran them
        self.update_paths: dict[str, int] = {"cpu_loop": 0, "reference": 0, "triton": 0}
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        # torch's __getstate__ keeps defaults, state and param_groups only: a deepcopy or a
        # pickle would lose this public counter (torch's suite checks public attributes)
        return {**super().__getstate__(), "update_paths": dict(self.update_paths)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("update_paths", {"cpu_loop": 0, "reference": 0, "triton": 0})

    def _check_options(self, group: dict[str, Any], where: str) -> None:
        super()._check_options(group, where)
        # torch's conditions: momentum >= 0 (no upper bound), dampening any number
        m = group["momentum"]
        if not (is_real_number(m) and m >= 0.0):
            raise ValueError(f"{where}Invalid momentum value: {m!r} (momentum must be a number >= 0)")
        d = group["dampening"]
        if not is_real_number(d):
            raise TypeError(f"{where}dampening={d!r} is invalid: it must be a number")
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"{where}nesterov={group['nesterov']!r} is invalid: it must be True or False")
        if group["nesterov"] and (m == 0 or d != 0):
            raise ValueError(
                f"{where}nesterov=True needs momentum > 0 and dampening=0 "
                f"(got momentum={m!r}, dampening={d!r}), as in torch.optim.SGD"
            )
        if group["spike_compensation"] and group["nesterov"]:
            raise ValueError(
                f"{where}spike_compensation=True cannot be combined with nesterov=True: SC with "
                "delay D=1 *is* the Nesterov update, and for other delays SC replaces it; use "
                "spike_compensation=True alone (D = the group's delay)"
            )
        if group["spike_compensation"] and m > 1.0:
            raise ValueError(
                f"{where}spike_compensation=True needs momentum <= 1 (got {m!r}): its "
                "coefficients m^D and (1 - m^D) / (1 - m) compensate a decaying momentum sum"
            )
        if group["prediction"] is not None and m == 0:
            raise ValueError(
                f"{where}prediction={group['prediction']!r} needs momentum > 0: SGD's prediction "
                "extrapolates along the momentum buffer, and without momentum there is nothing "
                "to extrapolate (set momentum, or prediction=None)"
            )

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        keys = []
        if group["momentum"] != 0:
            keys.append("momentum_buffer")
        if self._delta_gamma(group) is not None:
            keys.append("delta")
        return keys

    def _is_fresh(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        return group["momentum"] != 0 and "momentum_buffer" not in state

    def _ensure_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> bool:
        fresh = self._is_fresh(group, state)
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
        lr: float | Tensor
        if fn is self._paths.fused:
            lr = lr_values.for_launch(group, param.device)  # (param: a tensor or a segment table)
        else:
            lr = self.effective_lr(group)
        gamma = self._delta_gamma(group)
        coeff: float | Tensor = 0.0
        if predicted is not None:
            rule = _functional().prediction_coeff
            if isinstance(lr, Tensor):  # lr * c on the device, the bits the float path has
                coeff = lr_product(lr, rule(group["prediction"], 1.0, group["momentum"],
                                            self._horizon(group)))
            else:
                coeff = rule(group["prediction"], lr, group["momentum"], self._horizon(group))
        sc_delay = group["delay"] if group["spike_compensation"] else 0
        ref = self._paths.reference
        weight_decay = scalar(group["weight_decay"])
        if fn is ref and group["differentiable"]:
            # autograd through the step reaches Tensor hyperparameters, as in torch: pass them
            if isinstance(group["lr"], Tensor) and "lr_scale" not in group:
                lr = group["lr"]
            weight_decay = group["weight_decay"]
        ran_loop = fn(
            param,
            grad,
            state.get("momentum_buffer"),
            lr=lr,
            momentum=group["momentum"],
            dampening=group["dampening"],
            weight_decay=weight_decay,
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            init_momentum=init,
            sc_delay=sc_delay,
            predicted=predicted,
            predict_coeff=coeff,
            delta=state.get("delta") if gamma is not None else None,
            delta_gamma=gamma if gamma is not None else 0.0,
            dc_coeff=self._dc_coeff(group),
            grad_scale=grad_scale,
            found_inf=found_inf,
            validate=False,
        )
        path = "cpu_loop" if ran_loop is True else "reference" if fn is ref or ran_loop is False else "triton"
        self.update_paths[path] += 1

    def _sparse_update(self, group: dict[str, Any], p: Tensor) -> None:
        state = self.state.get(p)
        fresh = state is None
        state = {} if fresh else state
        _functional().sgd_sparse_update(
            p, p.grad, state, lr=self.effective_lr(group), momentum=group["momentum"],
            dampening=group["dampening"], weight_decay=scalar(group["weight_decay"]),
            nesterov=group["nesterov"], maximize=group["maximize"],
        )
        if fresh and state:
            self.state[p] = state

    _direction_key = "momentum_buffer"

    def _prediction_coeff(self, group: dict[str, Any], horizon: float) -> float | Tensor:
        lr = group.get("prediction_lr")
        rule = _functional().prediction_coeff
        if isinstance(lr, Tensor):
            # kept on the device by a step with a device lr: the coefficient stays there too
            # (lr * c with the host's arithmetic), so a captured window recomputing a
            # prediction reads nothing back (a read would keep such windows eager for good)
            return lr_product(lr, rule(group["prediction"], 1.0, group["momentum"], horizon))
        if lr is None:
            lr = self.effective_lr(group)
        return rule(group["prediction"], lr, group["momentum"], horizon)
