"""Shared machinery of the delay-aware optimizers: validation, dispatch, flat buffers, state.

Every engine optimizer is a ``torch.optim.Optimizer`` subclass whose update rule lives in two
interchangeable places: ``engine.optim.functional`` (plain torch, in place, the readable
reference that equals torch.optim bit for bit with the extra options off) and
``triton_kernels`` (fused Triton kernels with the same signatures; chosen in
:mod:`engine.optim.dispatch`). This module decides, per param group and step, which of the
two runs and over what tensors:

* ``fused=None`` runs Triton when the group's tensors live on CUDA and the reference path
  otherwise; ``fused=True`` always runs Triton (on CPU through ``TRITON_INTERPRET=1``);
  ``fused=False`` always runs the reference path.
* A group whose parameters are bound to flat buffers (:mod:`engine.optim.flat`: handed over
  by the pipeline runtime, or found through ``engine.flatten_``'s arena link) is updated with
  ONE call per flat buffer, with flat state buffers; each param's state entry is a view into
  the flat state, so ``state_dict`` keeps torch's per-param layout. Otherwise there is one
  call per tensor.

Learning-rate rescaling (PipeMare T1, see ``lr_scheduler.PipeMareLR``) is a per-group
multiplier ``group["lr_scale"]`` applied at step time: the update uses
``group["lr"] * group["lr_scale"]``. Keeping the multiplier apart from ``group["lr"]`` is what
lets PipeMareLR chain with StepLR/OneCycleLR, which own ``group["lr"]``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from engine.optim import functional
from engine.optim.computed import ComputedWeights
from engine.optim.dispatch import kernels, use_fused
from engine.optim.flat import FlatBinding, arena_binding
from engine.optim.options import (
    DELAY_DEFAULTS,
    PREDICTION_MODES,
    check_delay_options,
    is_real_number,
)

__all__ = ["DelayOptimizer", "PREDICTION_MODES", "DELAY_DEFAULTS"]

# kept for the subclasses' imports
_is_real_number = is_real_number
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _option_key(group: dict[str, Any]) -> tuple[Any, ...]:
    """The group's option values, comparable with ==, to tell whether they changed (tensors
    by identity: comparing their values would need a host read; the params list by identity,
    it is checked separately). Runs every step: a list comprehension, no generator."""
    return tuple([id(v) if isinstance(v, (Tensor, list)) else v for v in group.values()])


def _functional() -> Any:
    return functional


class DelayOptimizer(ComputedWeights, Optimizer):
    """Base class of ``engine.optim.SGD``, ``Adam`` and ``AdamW``.

    Subclasses provide the family name (``"sgd"`` / ``"adam"``), the per-param state keys a
    group needs, their own option checks, and the call into the update function. Everything
    else (validation before any state change, AMP arguments, the fused/reference and the
    flat/per-tensor dispatch, predicted and backward weights) lives here so the two families
    cannot drift apart.
    """

    # torch.amp.GradScaler hands grad_scale/found_inf to optimizers that set this, instead of
    # unscaling the grads itself; our update functions divide by grad_scale and skip the whole
    # update when found_inf != 0, on the device, without a host sync.
    _step_supports_amp_scaling = True

    _family: str = ""  # "sgd" or "adam": picks the update functions

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        # Check the defaults before torch stores anything, so a bad keyword fails with the
        # keyword's own name rather than as "param_groups[0]".
        self._check_options(defaults, where="")
        self._predicted: dict[Tensor, Tensor] = {}
        self._predicted_setting: dict[Tensor, tuple[Any, ...]] = {}
        self._bindings: dict[int, list[FlatBinding]] = {}  # group -> explicit bindings
        self._bind_order: list[tuple[int, FlatBinding]] = []
        self._auto: dict[int, tuple[tuple[int, ...], list[FlatBinding]]] = {}
        self._checked: dict[int, tuple[int, ...]] = {}  # group -> param ids validated
        self.last_step_predicted = False
        self._kernel_pair = kernels(self._family)
        self._fuse_cache: dict[int, tuple[Any, ...]] = {}
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ validation

    def _check_options(self, group: dict[str, Any], where: str) -> None:
        """Raise a ValueError naming the option, its value and ``where`` (the group) if any
        option of ``group`` is out of range. Subclasses extend it with their own options."""
        check_delay_options(group, where)

    def _check_group(self, group: dict[str, Any], index: int) -> None:
        """Options plus the checks that need the group's tensors."""
        where = f"param_groups[{index}]: "
        self._check_options(group, where)
        for j, p in enumerate(group["params"]):
            if torch.is_complex(p):
                raise ValueError(
                    f"{where}params[{j}] is complex ({p.dtype}); engine optimizers support real "
                    "params only: pass torch.view_as_real(param) views instead"
                )
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(
                    f"{where}params[{j}] is {p.dtype}; param must be float32, bfloat16 or float16"
                )
        if group["fused"] is True and any(p.device.type == "cpu" for p in group["params"]):
            if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
                raise RuntimeError(
                    f"{where}fused=True with CPU tensors runs the Triton kernels through Triton's "
                    "interpreter, which needs TRITON_INTERPRET=1 in the environment before "
                    "triton_kernels is imported (export it, or set it at the top of conftest.py); "
                    "otherwise pass fused=None or fused=False for the plain-torch path"
                )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group, with every option checked before the group is added."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError(
                "optimizer parameters need to be organized in ordered collections, but the "
                "ordering of tensors in sets will change between runs. Please use a list instead."
            )
        else:
            params = list(params)
        param_group = dict(param_group, params=params)
        # torch also accepts named params, (name, tensor) pairs: check the tensors
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        merged = {**self.defaults, **param_group, "params": tensors}
        self._check_group(merged, len(getattr(self, "param_groups", [])))
        super().add_param_group(param_group)
        if hasattr(self, "_checked"):
            self._checked.clear()
            self._auto.clear()

    def _check_before_step(self) -> None:
        """All checks of a step, run for every group before any group is updated so that a
        bad group (or sparse gradient) never leaves the optimizer half-stepped.

        Validation happens once per layout: the per-parameter checks run again only when a
        group's parameter list changes, the option checks only when an option's value does
        (an lr scheduler changes ``lr``: then the options are checked again)."""
        checked = self._checked
        for i, group in enumerate(self.param_groups):
            params = group["params"]
            pkey = (id(params), len(params))
            okey = _option_key(group)
            seen = checked.get(i)
            if seen is None or seen[0] != pkey:
                self._check_group(group, i)
            elif seen[1] != okey:
                self._check_options(group, f"param_groups[{i}]: ")
            checked[i] = (pkey, okey)
            if i in self._bindings:
                continue  # bound buckets hold dense flat gradients by construction
            for j, p in enumerate(params):
                g = p.grad
                if g is not None and g.is_sparse:
                    raise RuntimeError(
                        f"param_groups[{i}]['params'][{j}] has a sparse gradient; "
                        f"{type(self).__name__} updates dense tensors only (use "
                        "torch.optim.SparseAdam, or nn.Embedding(sparse=False))"
                    )

    # ------------------------------------------------------------------ options

    @staticmethod
    def effective_lr(group: dict[str, Any]) -> float:
        """The learning rate this group's next update uses: ``lr * lr_scale``.

        ``lr_scale`` is PipeMareLR's multiplier; when absent the lr is used untouched (no
        multiplication at all, so results stay bit-identical to torch.optim).
        """
        lr = group["lr"]
        lr = float(lr) if isinstance(lr, Tensor) else lr
        if "lr_scale" in group:
            return lr * group["lr_scale"]
        return lr

    def effective_lrs(self) -> list[float]:
        """``effective_lr`` of every param group, in order."""
        return [self.effective_lr(g) for g in self.param_groups]

    @staticmethod
    def _correction_gamma(group: dict[str, Any]) -> float | None:
        """PipeMare T2's gamma_s = D_decay ** (1 / tau_s), or None when the group keeps no
        delta (correction off, or tau_s = 0: with no delay there is nothing to correct)."""
        if not group["discrepancy_correction"] or group["delay"] == 0:
            return None
        return group["correction_decay"] ** (1.0 / group["delay"])

    @staticmethod
    def _horizon(group: dict[str, Any]) -> float:
        """Prediction horizon H: ``prediction_horizon`` if set, else the group's delay."""
        h = group["prediction_horizon"]
        return group["delay"] if h is None else h

    # ------------------------------------------------------------------ subclass hooks

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        """Per-param state tensors (shaped like the param) the group needs."""
        raise NotImplementedError

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
        """Run ``fn`` (reference or fused update) over one tensor or one flat buffer."""
        raise NotImplementedError

    # ------------------------------------------------------------------ flat buffers

    def bind_flat(self, bindings: Sequence[FlatBinding]) -> None:
        """Update the tensors of each binding with one call over its flat buffers.

        Every binding's ``params`` must be tensors of one param group of this optimizer, in
        the flat buffer's order. Called by the pipeline runtime once per stage; validated
        here, so that a step never needs to look anything up."""
        where: dict[int, int] = {}
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                where[id(p)] = g
        grouped: dict[int, list[FlatBinding]] = {}
        order: list[tuple[int, FlatBinding]] = []
        for k, b in enumerate(bindings):
            b.check()
            gs = {where.get(id(p)) for p in b.params}
            if None in gs or len(gs) != 1:
                raise ValueError(
                    f"flat binding {k} holds tensors of {'no' if None in gs else 'several'} "
                    "param group(s) of this optimizer; a binding must hold tensors of exactly "
                    "one group"
                )
            g = gs.pop()
            assert g is not None
            b.grad_views = tuple(b.view._grad_views) if b.view.grad is not None else ()
            b.state = {}
            b.initialized = False
            grouped.setdefault(g, []).append(b)
            order.append((g, b))
        self._bindings = grouped
        self._bind_order = order
        self._auto.clear()

    def _fused_choice(self, index: int, group: dict[str, Any], params: list[Tensor]) -> bool:
        """``use_fused`` for the group, recomputed only when its option or tensors change."""
        key = (group["fused"], id(group["params"]), len(params), params[0].device)
        cached = self._fuse_cache.get(index)
        if cached is not None and cached[0] == key:
            return cached[1]
        choice = use_fused(group, params)
        self._fuse_cache[index] = (key, choice)
        return choice

    def _group_bindings(self, index: int, group: dict[str, Any]) -> list[FlatBinding]:
        explicit = self._bindings.get(index)
        if explicit is not None:
            return explicit
        params = group["params"]
        ids = tuple(map(id, params))
        cached = self._auto.get(index)
        if cached is not None and cached[0] == ids:
            return cached[1]
        found = arena_binding(list(params))
        result = [found] if found is not None else []
        self._auto[index] = (ids, result)
        return result

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
    ) -> Any:
        """One update of every param group.

        ``grad_scale``/``found_inf`` are AMP's device tensors: grads are divided by
        ``grad_scale`` inside the update and the whole update (state included) is skipped where
        ``found_inf`` is non-zero. The fused kernels do this on the device with no host
        synchronisation; the reference path reads ``found_inf`` once per tensor (a host read,
        acceptable on CPU where it runs). torch.amp.GradScaler passes them
        as attributes of the optimizer (``_step_supports_amp_scaling``); explicit arguments win.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        self._check_before_step()
        wrote = True
        for index, group in enumerate(self.param_groups):
            wrote &= self._step_group(index, group, grad_scale, found_inf)
        self.last_step_predicted = wrote
        return loss

    def _step_group(
        self, index: int, group: dict[str, Any], grad_scale: Tensor | None, found_inf: Tensor | None
    ) -> bool:
        """Update one group; returns False when a binding with a ``predicted`` buffer was not
        stepped as a whole (so that buffer was not written)."""
        bindings = self._group_bindings(index, group)
        if len(bindings) == 1 and bindings[0].covers(group["params"]) and bindings[0].grads_in_buffer():
            # the steady state of a bound stage: one flat update, no per-parameter work
            params = group["params"]
        else:
            params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return all(b.predicted is None for b in bindings)
        if group["prediction"] is not None:
            # Predictions extrapolate with the lr of the step that produced their direction, also
            # when recomputed later (other horizon, after load_state_dict): a group key, so it
            # is saved with the state_dict and a resumed run predicts exactly as before.
            group["prediction_lr"] = self.effective_lr(group)
        ref, fused = self._kernel_pair
        fuse = self._fused_choice(index, group, params)
        done: set[int] = set()
        wrote = True
        for b in bindings:
            if self._flat_step(group, b, ref, fused, fuse, grad_scale, found_inf):
                if len(bindings) == 1 and params is group["params"]:
                    return wrote  # covered whole (checked above)
                done.update(map(id, b.params))
            elif b.predicted is not None:
                wrote = False
        for p in params:
            if id(p) in done:
                continue
            state = self.state[p]
            init = self._ensure_state(group, p, state)
            predicted = self._predicted_buffer(group, p, p)
            # Zero-size and non-contiguous tensors take the reference path: the kernels read
            # memory as contiguous and a zero-size launch has nothing to do (but Adam's step
            # count must still advance, as torch's does).
            tensors = {k: state[k] for k in self._state_keys(group)}
            contiguous = p.is_contiguous() and p.grad.is_contiguous() and all(t.is_contiguous() for t in tensors.values())
            fn = fused if (fuse and p.numel() > 0 and contiguous) else ref
            if "step" in state:
                tensors["step"] = state["step"]
            self._call_update(fn, group, p, p.grad, tensors, init, predicted, grad_scale, found_inf)
        return wrote

    def _new_state_tensor(self, p: Tensor) -> Tensor:
        """Zero state shaped like ``p``. State is fp32 whatever the param dtype (the math
        layer's convention): bf16 moments would lose the small increments they accumulate."""
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def _ensure_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> bool:
        """Create the missing state tensors of ``p``; returns True on the param's first step
        (SGD then initialises its momentum buffer to g', as torch does)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ flat path

    def _flat_step(
        self,
        group: dict[str, Any],
        b: FlatBinding,
        ref: Callable[..., Any],
        fused: Callable[..., Any],
        fuse: bool,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> bool:
        """One update over a binding's flat buffers; False when it does not qualify.

        It qualifies when every tensor of the binding has a gradient in the flat gradient
        buffer (torch skips tensors without grads; the flat update would move them through
        weight decay and momentum) and all of them are at the same point of their life (all
        fresh or all stepped), since one call has one ``init_momentum`` flag and one step
        count. Once a binding has been stepped whole, only the gradient check runs per step.
        """
        view = b.view
        if view.grad is None:
            return False
        params = b.params
        if not b.grads_in_buffer():
            for p in params:
                if p.grad is None:
                    return False
            b.rebind_grads()
        if b.initialized:
            init = False
        else:
            fresh = [self._is_fresh(group, self.state[p]) for p in params]
            if any(fresh) and not all(fresh):
                return False
            init = all(fresh)
        flat = self._binding_state(group, b)
        if self._family == "adam":
            step = flat.get("step") if b.initialized else self._flat_step_tensor(group, list(params))
            if step is None:
                return False
            flat["step"] = step
        predicted = None
        if group["prediction"] is not None:
            predicted = b.predicted
            if predicted is None:
                predicted = flat.get("predicted")
                if predicted is None or predicted.shape != view.param.shape:
                    predicted = torch.empty_like(view.param)
                    flat["predicted"] = predicted
            if b.state.get("_pred_target") is not predicted:
                setting = (group["prediction"], self._horizon(group))
                for p, off, n in zip(params, view.offsets, view.numels, strict=True):
                    self._predicted[p] = predicted[off : off + n].view_as(p)
                    self._predicted_setting[p] = setting
                b.state["_pred_target"] = predicted
        fn = fused if fuse and view.param.numel() > 0 else ref
        tensors = {k: flat[k] for k in self._state_keys(group)}
        if "step" in flat:
            tensors["step"] = flat["step"]
        self._call_update(fn, group, view.param, view.grad, tensors, init, predicted, grad_scale, found_inf)
        b.initialized = True
        return True

    def _binding_state(self, group: dict[str, Any], b: FlatBinding) -> dict[str, Tensor]:
        """Flat state buffers of a binding, created once (each param's state entry becomes a
        view into them; existing values are copied in)."""
        flat = b.state
        for key in self._state_keys(group):
            if key in flat:
                continue
            buf, views = b.view.make_state(dtype=torch.float32)
            for p, view in zip(b.params, views, strict=True):
                old = self.state[p].get(key)
                if old is not None:
                    view.copy_(old)
                self.state[p][key] = view
            flat[key] = buf
        return flat

    def _is_fresh(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        """True when the param has not been stepped yet (its state would be created now)."""
        raise NotImplementedError

    def _flat_step_tensor(self, group: dict[str, Any], params: list[Tensor]) -> Tensor | None:
        """Adam's step count shared by every param of a flat bucket (one object, so the one
        in-place increment of the flat update advances every param's ``state['step']``)."""
        steps = [self.state[p].get("step") for p in params]  # once per binding
        if all(s is None for s in steps):
            shared = torch.zeros((), dtype=torch.float32, device=params[0].device)
        elif any(s is None for s in steps):
            return None
        elif all(s is steps[0] for s in steps):
            return steps[0]
        else:
            # After load_state_dict every param has its own copy; share them again if they
            # agree (one host sync, only on this rebuild), else stay per tensor.
            first = steps[0]
            if not all(bool(torch.equal(s.to(first.device), first)) for s in steps[1:]):
                return None
            shared = first.detach().to(dtype=torch.float32, device=params[0].device).clone()
        for p in params:
            self.state[p]["step"] = shared
        return shared

    # ------------------------------------------------------------------ state_dict

    def _forget_flat_state(self) -> None:
        """The per-param state was replaced: flat state buffers are re-created (from the new
        values) at the next step, predictions recomputed."""
        for bindings in self._bindings.values():
            for b in bindings:
                b.state = {}
                b.initialized = False
        self._auto.clear()
        self._predicted.clear()
        self._predicted_setting.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict; also forgets flat buffers and cached predictions, which
        point at the replaced state (the next step re-creates them from the loaded values)."""
        super().load_state_dict(state_dict)
        # A state_dict from torch.optim (or an older engine version) lacks the delay options:
        # fill them from this optimizer's defaults so it keeps stepping.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self._restore_state_dtypes(state_dict)
        self._forget_flat_state()

    def _restore_state_dtypes(self, state_dict: dict[str, Any]) -> None:
        """Undo torch's cast of state to the param dtype: torch.optim.Optimizer.load_state_dict
        casts every floating state tensor to the param's dtype, but our state is fp32 for
        every param dtype (a bf16 param's fp32 moments would be rounded to bf16 and the math
        layer would refuse them). Re-copy those entries from the saved values as fp32, and put
        Adam's step count on the param's device (the fused kernels read it there)."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            for pid, p in zip(saved["params"], group["params"], strict=True):
                entry = saved_state.get(pid)
                if entry is None or p not in self.state:
                    continue
                for key, value in entry.items():
                    if not isinstance(value, Tensor):
                        continue
                    if key == "step":
                        self.state[p][key] = value.detach().to(device=p.device, dtype=torch.float32).clone()
                    elif value.is_floating_point():
                        self.state[p][key] = value.detach().to(device=p.device, dtype=torch.float32).clone()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_predicted", {})
        self.__dict__.setdefault("_predicted_setting", {})
        self.__dict__.setdefault("_bindings", {})
        self.__dict__.setdefault("_bind_order", [])
        self.__dict__.setdefault("_auto", {})
        self.__dict__.setdefault("_checked", {})
        self.__dict__.setdefault("last_step_predicted", False)
        self.__dict__.setdefault("_kernel_pair", kernels(self._family))
        self.__dict__.setdefault("_fuse_cache", {})
        for group in self.param_groups:
            for key, value in DELAY_DEFAULTS.items():
                group.setdefault(key, value)
