"""Shared machinery of the delay-aware optimizers: validation, dispatch, flat buffers, state.

Every engine optimizer is a ``torch.optim.Optimizer`` subclass whose update rule lives in two
interchangeable places: ``engine.optim.functional`` (plain torch, in place, the readable
reference that equals torch.optim bit for bit with the extra options off) and
``engine.triton_kernels`` (fused Triton kernels with the same signatures; chosen in
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

Learning-rate rescaling (PipeMare T1, see ``lr_scheduler.PipeMareLR``) writes the applied
rate into ``group["lr"]``, as torch's schedulers do. A ``group["lr_scale"]`` (where PipeMareLR
kept its multiplier before; old checkpoints carry it) is still applied at step time:
``group["lr"] * group["lr_scale"]``, until PipeMareLR's next step folds it into ``lr``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from engine.optim import functional, lr_values
from engine.optim.computed import ComputedWeights
from engine.optim.dispatch import FUSED_DTYPES, paths, use_fused
from engine.optim.flat import FlatBinding, arena_binding
from engine.optim.multi import MultiTensorSteps
from engine.optim.options import DELAY_DEFAULTS, PREDICTION_MODES
from engine.optim.state_io import StateDictIO
from engine.optim.validation import OptionChecks

__all__ = ["DelayOptimizer", "PREDICTION_MODES", "DELAY_DEFAULTS", "MOMENT_KEYS"]

#: torch's own state, which the ``state_dtype`` option may keep in bf16/fp16
MOMENT_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")

_EMPTY: dict[str, Any] = {}
_warned_fallback: set[Any] = set()


def _grad_mode_for_differentiable(step: Callable[..., Any]) -> Callable[..., Any]:
    """torch.optim's convention: step() runs without autograd, unless the optimizer was
    built with ``differentiable=True`` (then gradients flow through the update)."""

    @functools.wraps(step)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.set_grad_enabled(bool(self.defaults.get("differentiable", False))):
            return step(self, *args, **kwargs)

    return wrapper


def _fallback_once(reason: str) -> None:
    """Say once per reason that a fused request runs on the reference path."""
    if reason not in _warned_fallback:
        _warned_fallback.add(reason)
        warnings.warn(reason, stacklevel=4)


def _functional() -> Any:
    return functional


class DelayOptimizer(OptionChecks, StateDictIO, ComputedWeights, MultiTensorSteps, Optimizer):
    """Base class of ``engine.optim.SGD``, ``Adam``, ``AdamW`` and ``NAdam``.

    Subclasses provide the family name (``"sgd"``, ``"adam"``, ``"nadam"``), the state keys a
    group needs, their own option checks, and the call into the update function. Everything
    else (validation before any state change, AMP arguments, the fused/reference and the
    flat/per-tensor dispatch, predicted and backward weights) lives here so the two families
    cannot drift apart.
    """

    # torch.amp.GradScaler hands grad_scale/found_inf to optimizers that set this, instead of
    # unscaling the grads itself; our update functions divide by grad_scale and skip the whole
    # update when found_inf != 0, on the device, without a host sync.
    _step_supports_amp_scaling = True

    _family: str = ""  # "sgd", "adam" or "nadam": picks the update functions
    #: one-element state every param of a flat bucket shares, with its initial value (Adam's
    #: step count; NAdam's also its momentum product)
    _shared_scalars: tuple[tuple[str, float], ...] = ()

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
        self._paths = paths(self._family)
        self._fuse_cache: dict[int, tuple[Any, ...]] = {}
        self._layouts = {}  # multi-tensor launches per group (engine.optim.multi)
        self._state_version = 0
        self._bucket_tables = {}
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ options

    @staticmethod
    def effective_lr(group: dict[str, Any]) -> float:
        """The learning rate this group's next update uses, as a number (lr_values.number)."""
        return lr_values.number(group)

    #: the group's lr as the fused kernels load it on a device, or None (lr_values.on_device)
    device_lr = staticmethod(lr_values.on_device)

    def set_group_options(self, **options: Any) -> None:
        """Write ``options`` into every param group, each group checked with them first as a
        constructor's keywords are: a bad value raises a ValueError naming it and the group,
        and nothing is written. The pipeline sets the options its mitigations need this way
        (docs/DESIGN.md, "One switch per mitigation")."""
        for i, group in enumerate(self.param_groups):
            self._check_options({**group, **options}, f"param_groups[{i}]: ")
        for group in self.param_groups:
            group.update(options)

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
    def _delta_gamma(group: dict[str, Any]) -> float | None:
        """gamma_s of the group's delta buffer, which PipeMare T2 and delay compensation
        share (one buffer when both are on; DC keeps its own when T2 is off), or None when
        the group keeps no delta (both off, or tau_s = 0)."""
        if group["delay"] == 0 or not (
            group["discrepancy_correction"] or group.get("delay_compensation", 0.0)
        ):
            return None
        return group["correction_decay"] ** (1.0 / group["delay"])

    @staticmethod
    def _dc_coeff(group: dict[str, Any]) -> float:
        """lambda * tau_s: the delay-compensated gradient is g + lambda * g * g * (tau_s *
        delta), tau_s * delta estimating w_t - w_(t-tau) (ALGORITHMS.md); 0.0 when off."""
        return float(group.get("delay_compensation", 0.0)) * group["delay"]

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
        if choice:
            odd = sorted({str(p.dtype) for p in params if p.dtype not in FUSED_DTYPES})
            if odd:
                _fallback_once(
                    f"{type(self).__name__}: the fused kernels update float32, bfloat16 and "
                    f"float16 params; {', '.join(odd)} params take the reference path "
                    "(torch ops, same math), and so does the rest of their param group"
                )
                choice = False
        self._fuse_cache[index] = (key, choice)
        return choice

    def _group_bindings(self, index: int, group: dict[str, Any]) -> list[FlatBinding]:
        explicit = self._bindings.get(index)
        if explicit is not None:
            return explicit
        params = group["params"]
        # the list's identity and length, as FlatBinding.covers: a group's list changes only
        # through add_param_group or load_state_dict, which rebuild it (and clear _auto)
        ids = (id(params), len(params))
        cached = self._auto.get(index)
        if cached is not None and cached[0] == ids:
            return cached[1]
        found = arena_binding(list(params))
        result = [found] if found is not None else []
        self._auto[index] = (ids, result)
        return result

    # ------------------------------------------------------------------ step

    @_grad_mode_for_differentiable
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
        if group["differentiable"]:
            # autograd through the update: the reference path, one tensor at a time
            params = [p for p in group["params"] if p.grad is not None]
            if group["prediction"] is not None:
                group["prediction_lr"] = self.effective_lr(group)
            self._step_tensors(group, params, False, grad_scale, found_inf)
            return True
        bindings = self._group_bindings(index, group)
        if len(bindings) == 1 and bindings[0].steady:
            # the steady state of a bound stage (checked by _check_before_step): one flat
            # update, no per-parameter work
            params = group["params"]
        else:
            params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return all(b.predicted is None for b in bindings)
        fuse = self._fused_choice(index, group, params)
        if group["prediction"] is not None:
            # Predictions extrapolate with the lr of the step that produced their direction, also
            # when recomputed later (other horizon, after load_state_dict): a group key, so it
            # is saved with the state_dict and a resumed run predicts exactly as before.
            lr_values.record_for_prediction(group, params[0].device if fuse else None)
        done: set[int] = set()
        wrote = True
        # several fused buckets: one multi-tensor launch per dtype signature, after the loop
        batch: list[tuple[Any, ...]] | None = [] if fuse and len(bindings) > 1 else None
        for b in bindings:
            if self._flat_step(group, b, fuse, grad_scale, found_inf, batch):
                if len(bindings) == 1 and params is group["params"]:
                    return wrote  # covered whole (checked above)
                done.update(map(id, b.params))
            elif b.predicted is not None:
                wrote = False
        if batch:
            self._multi_buckets(group, batch, grad_scale, found_inf)
        self._step_tensors(group, [p for p in params if id(p) not in done], fuse, grad_scale, found_inf)
        return wrote

    def _step_tensors(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        fuse: bool,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        """Params not in a flat buffer: fused, one launch per dtype signature
        (:mod:`engine.optim.multi`); what the kernels cannot take, one update call per tensor."""
        if fuse and params:
            params = self._multi_tensors(group, params, grad_scale, found_inf)
        keys = self._state_keys(group)
        for p in params:
            if p.grad.is_sparse:
                self._sparse_update(group, p)
                continue
            # no state entry for a param whose update keeps none (torch: SGD without momentum)
            state = self.state.get(p)
            if state is None:
                state = {}
            init = self._ensure_state(group, p, state)
            if state and p not in self.state:
                self.state[p] = state
            predicted = self._predicted_buffer(group, p, p)
            tensors = {k: state[k] for k in keys}
            for key, _ in self._shared_scalars:
                tensors[key] = state[key]
            param, grad = p, p.grad
            # Zero-size and non-contiguous tensors take the reference path: the kernels read
            # memory as contiguous and a zero-size launch has nothing to do (but Adam's step
            # count must still advance, as torch's does).
            contiguous = param.is_contiguous() and grad.is_contiguous() and all(
                t.is_contiguous() for k, t in tensors.items() if k != "step"
            )
            fn = self._paths.choose(fuse and p.numel() > 0 and contiguous, group, predicted)
            self._call_update(fn, group, param, grad, tensors, init, predicted, grad_scale, found_inf)

    def _sparse_update(self, group: dict[str, Any], p: Tensor) -> None:
        """One update with a sparse gradient (SGD only; refused before the step otherwise)."""
        raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")

    def _new_state_tensor(self, p: Tensor, group: dict[str, Any] | None = None,
                          key: str = "") -> Tensor:
        """Zero state shaped like ``p``: fp32 for fp32/bf16/fp16 params (bf16 moments would
        lose the small increments they accumulate), fp64 for fp64, and complex state for
        complex params (torch's layout; the update reads it as a real view); a moment of a
        group with ``state_dtype`` set: :meth:`_state_dtype_of`."""
        if torch.is_complex(p):
            return torch.zeros_like(p, memory_format=torch.preserve_format)
        dtype = self._state_dtype_of(group, p.dtype, key) if group is not None else \
            functional.state_dtype(p.dtype)
        return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    @staticmethod
    def _state_dtype_of(group: dict[str, Any], dtype: torch.dtype, key: str) -> torch.dtype:
        """The dtype of state ``key`` of a ``dtype`` param in ``group``. The group's
        ``state_dtype`` ("param", or bf16/fp16 for params of that dtype) applies to torch's
        state, the moments (MOMENT_KEYS); everything else (and every other param dtype) keeps
        functional.state_dtype: delta and last_update carry exact contracts in fp32."""
        choice = group.get("state_dtype")
        if (choice is None or key not in MOMENT_KEYS
                or dtype not in functional.LOW_PRECISION or choice is torch.float32):
            return functional.state_dtype(dtype)
        if choice == "param" or choice is dtype:
            return dtype
        return functional.state_dtype(dtype)

    def _convert_state_dtypes(self, group: dict[str, Any]) -> None:
        """Bring the group's existing state to its ``state_dtype`` (after the option changed,
        or a state_dict was loaded): each moment converted (rounded to nearest even when
        narrowed), flat state re-created from the converted values at the next step."""
        changed = False
        for p in group["params"]:
            entry = self.state.get(p)
            if not entry or torch.is_complex(p):
                continue
            for key in MOMENT_KEYS:
                t = entry.get(key)
                if isinstance(t, Tensor) and not t.is_sparse:
                    dtype = self._state_dtype_of(group, p.dtype, key)
                    if t.dtype != dtype:
                        entry[key] = t.detach().to(dtype).clone()
                        changed = True
        if changed:
            self._forget_flat_state()
            self._bump_state_version()

    def _ensure_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> bool:
        """Create the missing state tensors of ``p``; returns True on the param's first step
        (SGD then initialises its momentum buffer to g', as torch does)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ flat path

    def _flat_step(
        self,
        group: dict[str, Any],
        b: FlatBinding,
        fuse: bool,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
        batch: list[tuple[Any, ...]] | None = None,
    ) -> bool:
        """One update over a binding's flat buffers; False when it does not qualify. With
        ``batch`` a fused update is appended there instead (the caller launches the batch).

        It qualifies when every tensor of the binding has a gradient in the flat gradient
        buffer (torch skips tensors without grads; the flat update would move them through
        weight decay and momentum) and all of them are at the same point of their life (all
        fresh or all stepped), since one call has one ``init_momentum`` flag and one step
        count. Once a binding has been stepped whole, only the gradient check runs per step.
        """
        view = b.view
        if view.grad is None or torch.is_complex(view.param):
            return False
        params = b.params
        if not (b.steady or b.grads_in_buffer()):
            for p in params:
                if p.grad is None:
                    return False
            b.rebind_grads()
        if b.initialized:
            init = False
        else:
            fresh = [self._is_fresh(group, self.state.get(p, _EMPTY)) for p in params]
            if any(fresh) and not all(fresh):
                return False
            init = all(fresh)
        flat = self._binding_state(group, b)
        for key, init_value in self._shared_scalars:
            shared = flat.get(key) if b.initialized else self._flat_scalar(list(params), key, init_value)
            if shared is None:
                return False
            flat[key] = shared
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
        fn = self._paths.choose(fuse and view.param.numel() > 0, group, predicted)
        tensors = {k: flat[k] for k in self._state_keys(group)}
        for key, _ in self._shared_scalars:
            tensors[key] = flat[key]
        if batch is not None and fn is self._paths.fused:
            batch.append((view.param, view.grad, tensors, init, predicted))
        else:
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
            buf, views = b.view.make_state(dtype=self._state_dtype_of(group, b.view.param.dtype, key))
            for p, view in zip(b.params, views, strict=True):
                old = self.state[p].get(key)
                if old is not None:
                    view.copy_(old)
                self.state[p][key] = view
            flat[key] = buf
            self._bump_state_version()
        return flat

    def _is_fresh(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        """True when the param has not been stepped yet (its state would be created now)."""
        raise NotImplementedError

    def _flat_scalar(self, params: list[Tensor], key: str, init_value: float) -> Tensor | None:
        """A one-element state (Adam's step count) shared by every param of a flat bucket (one
        object, so the one in-place update of the flat step advances every param's
        ``state[key]``)."""
        steps = [self.state[p].get(key) for p in params]  # once per binding
        if all(s is None for s in steps):
            shared = torch.full((), init_value, dtype=torch.float32, device=params[0].device)
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
            self.state[p][key] = shared
        self._bump_state_version()
        return shared
