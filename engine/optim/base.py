"""Shared machinery of the delay-aware optimizers: options, validation, dispatch, state.

Every engine optimizer is a ``torch.optim.Optimizer`` subclass whose update rule lives in two
interchangeable places: ``engine.optim.functional`` (plain torch, in place, the readable
reference that equals torch.optim bit for bit with the extra options off) and
``triton_kernels`` (fused Triton kernels with the same signatures). This module decides, per
param group and step, which of the two runs and over what tensors:

* ``fused=None`` runs Triton when the group's tensors live on CUDA and the reference path
  otherwise; ``fused=True`` always runs Triton (on CPU through ``TRITON_INTERPRET=1``);
  ``fused=False`` always runs the reference path.
* When a group's params are exactly one bucket of the C++ weight arena
  (``engine.arena.flat_buffers_for``), the update is ONE call over the flat buffer with flat
  state buffers; each param's state entry is a view into the flat state, so ``state_dict``
  keeps torch's per-param layout. Otherwise there is one call per tensor.

Delay-related options (``delay``, ``spike_compensation``, ``prediction``,
``prediction_horizon``, ``discrepancy_correction``, ``correction_decay``) are per-param-group
defaults like ``lr``, because the pipeline sets each stage's delay on its group.

Learning-rate rescaling (PipeMare T1, see ``lr_scheduler.PipeMareLR``) is a per-group
multiplier ``group["lr_scale"]`` applied at step time: the update uses
``group["lr"] * group["lr_scale"]``. Keeping the multiplier apart from ``group["lr"]`` is what
lets PipeMareLR chain with StepLR/OneCycleLR, which own ``group["lr"]``.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["DelayOptimizer", "PREDICTION_MODES"]

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


def _functional() -> Any:
    """The reference math layer; imported on first use so that ``import engine.optim`` never
    depends on it being importable (it is plain torch, but keeps start-up cheap)."""
    from engine.optim import functional

    return functional


def _is_real_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class DelayOptimizer(Optimizer):
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

    _family: str = ""  # "sgd" or "adam": picks triton_kernels.<family>

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        # Check the defaults before torch stores anything, so a bad keyword fails with the
        # keyword's own name rather than as "param_groups[0]".
        self._check_options(defaults, where="")
        self._predicted: dict[Tensor, Tensor] = {}
        self._predicted_setting: dict[Tensor, tuple[Any, ...]] = {}
        self._flat_cache: dict[int, dict[str, Tensor]] = {}
        self._arena_warned = False
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ validation

    def _check_options(self, group: dict[str, Any], where: str) -> None:
        """Raise a ValueError naming the option, its value and ``where`` (the group) if any
        option of ``group`` is out of range. Subclasses extend it with their own options."""
        lr = group["lr"]
        if isinstance(lr, Tensor):
            if lr.numel() != 1:
                raise ValueError(f"{where}lr must be a float or a 1-element tensor, got shape {tuple(lr.shape)}")
            lr_value = float(lr.detach())
        elif _is_real_number(lr):
            lr_value = float(lr)
        else:
            raise TypeError(f"{where}lr must be a float, got {type(lr).__name__} {lr!r}")
        if not lr_value >= 0.0:
            raise ValueError(f"{where}lr={lr!r} is invalid: the learning rate must be >= 0")
        scale = group.get("lr_scale", 1.0)
        if not (_is_real_number(scale) and scale >= 0.0):
            raise ValueError(f"{where}lr_scale={scale!r} is invalid: it must be a float >= 0 (PipeMareLR sets it)")
        wd = group["weight_decay"]
        if not (_is_real_number(wd) and wd >= 0.0):
            raise ValueError(f"{where}weight_decay={wd!r} is invalid: it must be a float >= 0")
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
        if horizon is not None and not (_is_real_number(horizon) and horizon >= 0 and math.isfinite(horizon)):
            raise ValueError(
                f"{where}prediction_horizon={horizon!r} is invalid: use None (the group's delay) or a number >= 0"
            )
        if mode == "momentum" and horizon is not None and int(horizon) != horizon:
            raise ValueError(
                f"{where}prediction_horizon={horizon!r} is invalid for prediction='momentum': it "
                "sums m + m^2 + ... + m^H, so H must be a whole number (or use 'linear')"
            )
        decay = group["correction_decay"]
        if not (_is_real_number(decay) and 0.0 < decay < 1.0):
            raise ValueError(
                f"{where}correction_decay={decay!r} is invalid: PipeMare's D_decay must lie in (0, 1) "
                "(gamma = D_decay ** (1 / delay))"
            )
        fused = group["fused"]
        if fused not in (None, True, False):
            raise ValueError(f"{where}fused={fused!r} is invalid: use None (auto), True or False")
        for name in ("maximize", "spike_compensation", "discrepancy_correction"):
            if not isinstance(group[name], bool):
                raise TypeError(f"{where}{name}={group[name]!r} is invalid: it must be True or False")

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

    def _check_before_step(self) -> None:
        """All checks of a step, run for every group before any group is updated so that a
        bad group (or sparse gradient) never leaves the optimizer half-stepped."""
        for i, group in enumerate(self.param_groups):
            self._check_group(group, i)
            for j, p in enumerate(group["params"]):
                if p.grad is not None and p.grad.is_sparse:
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

    def _prediction_direction_and_coeff(self, group: dict[str, Any], p: Tensor, horizon: float) -> tuple[Tensor | None, float]:
        """Direction and coefficient with w_hat = w - coeff * direction (None: no direction yet)."""
        raise NotImplementedError

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
        for index, group in enumerate(self.param_groups):
            self._step_group(index, group, grad_scale, found_inf)
        return loss

    def _use_fused(self, group: dict[str, Any], tensors: Sequence[Tensor]) -> bool:
        fused = group["fused"]
        if fused is None:
            return len(tensors) > 0 and all(t.device.type == "cuda" for t in tensors)
        return bool(fused)

    def _kernels(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """(reference, fused) update functions of this family; the fused one is imported on
        first use so CPU-only users never import Triton."""
        ref = getattr(_functional(), f"{self._family}_update")
        return ref, _FusedLoader(self._family)

    def _step_group(
        self, index: int, group: dict[str, Any], grad_scale: Tensor | None, found_inf: Tensor | None
    ) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        if group["prediction"] is not None:
            # Predictions extrapolate with the lr of the step that produced their direction, also
            # when recomputed later (other horizon, after load_state_dict): a group key, so it
            # is saved with the state_dict and a resumed run predicts exactly as before.
            group["prediction_lr"] = self.effective_lr(group)
        ref, fused = self._kernels()
        use_fused = self._use_fused(group, params)
        if self._try_flat_step(index, group, ref, fused, use_fused, grad_scale, found_inf):
            return
        for p in params:
            state = self.state[p]
            init = self._ensure_state(group, p, state)
            predicted = self._predicted_buffer(group, p, p)
            # Zero-size and non-contiguous tensors take the reference path: the kernels read
            # memory as contiguous and a zero-size launch has nothing to do (but Adam's step
            # count must still advance, as torch's does).
            tensors = {k: state[k] for k in self._state_keys(group)}
            contiguous = p.is_contiguous() and p.grad.is_contiguous() and all(t.is_contiguous() for t in tensors.values())
            fn = fused if (use_fused and p.numel() > 0 and contiguous) else ref
            if "step" in state:
                tensors["step"] = state["step"]
            self._call_update(fn, group, p, p.grad, tensors, init, predicted, grad_scale, found_inf)

    def _new_state_tensor(self, p: Tensor) -> Tensor:
        """Zero state shaped like ``p``. State is fp32 whatever the param dtype (the math
        layer's convention): bf16 moments would lose the small increments they accumulate."""
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def _ensure_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> bool:
        """Create the missing state tensors of ``p``; returns True on the param's first step
        (SGD then initialises its momentum buffer to g', as torch does)."""
        raise NotImplementedError

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

    # ------------------------------------------------------------------ flat (arena) path

    def _flat_view(self, group: dict[str, Any]) -> Any | None:
        """The arena's FlatView of this group, or None. Consulted only when the user already
        imported engine.arena (plain models never load the extension); any failure of the
        extension falls back to the per-tensor path with one warning, never breaks a step."""
        arena = sys.modules.get("engine.arena")
        if arena is None:
            return None
        try:
            return arena.flat_buffers_for(group["params"])
        except Exception as exc:  # noqa: BLE001 - a broken extension must not break the drop-in
            if not self._arena_warned:
                self._arena_warned = True
                warnings.warn(
                    f"engine.arena.flat_buffers_for failed ({type(exc).__name__}: {exc}); "
                    "updating tensor by tensor instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None

    def _try_flat_step(
        self,
        index: int,
        group: dict[str, Any],
        ref: Callable[..., Any],
        fused: Callable[..., Any],
        use_fused: bool,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> bool:
        """One update over the group's flat buffer; False when the group does not qualify.

        It qualifies when its params are one arena bucket, every param has a grad (torch skips
        params without grads; the flat update would move them through weight decay and
        momentum), and all params are at the same point of their life (all fresh or all
        stepped), since one call has one ``init_momentum`` flag and one step count.
        """
        params = group["params"]
        if not params or any(p.grad is None for p in params):
            return False
        fv = self._flat_view(group)
        if fv is None:
            return False
        fresh = [self._is_fresh(group, self.state[p]) for p in params]
        if any(fresh) and not all(fresh):
            return False
        if not fv.grads_are_views():
            fv.rebind_grads()
        if fv.grad is None:
            return False
        step = self._flat_step_tensor(group, params) if self._family == "adam" else None
        if self._family == "adam" and step is None:
            return False
        init = all(fresh)
        flat = self._flat_state(index, group, fv, params)
        if step is not None:
            flat["step"] = step
        predicted = None
        if group["prediction"] is not None:
            predicted = flat.setdefault("predicted", torch.zeros_like(fv.param))
            if predicted.shape != fv.param.shape or predicted.dtype != fv.param.dtype:
                predicted = flat["predicted"] = torch.zeros_like(fv.param)
            setting = (group["prediction"], self._horizon(group))
            for p, off, n in zip(params, fv.offsets, fv.numels, strict=True):
                self._predicted[p] = predicted[off : off + n].view_as(p)
                self._predicted_setting[p] = setting
        fn = fused if use_fused and fv.param.numel() > 0 else ref
        tensors = {k: flat[k] for k in self._state_keys(group)}
        if step is not None:
            tensors["step"] = step
        self._call_update(fn, group, fv.param, fv.grad, tensors, init, predicted, grad_scale, found_inf)
        return True

    def _is_fresh(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        """True when the param has not been stepped yet (its state would be created now)."""
        raise NotImplementedError

    def _flat_step_tensor(self, group: dict[str, Any], params: list[Tensor]) -> Tensor | None:
        """Adam's step count shared by every param of a flat bucket (one object, so the one
        in-place increment of the flat update advances every param's ``state['step']``)."""
        steps = [self.state[p].get("step") for p in params]
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

    def _flat_state(self, index: int, group: dict[str, Any], fv: Any, params: list[Tensor]) -> dict[str, Tensor]:
        """Flat state buffers of a bucket, re-created when a param's state entry is not (or no
        longer, e.g. after load_state_dict) the view into them that the flat update writes."""
        cache = self._flat_cache.setdefault(index, {})
        for key in self._state_keys(group):
            flat = cache.get(key)
            ok = flat is not None and flat.shape == fv.param.shape and flat.dtype == torch.float32
            if ok:
                base = flat.data_ptr()
                size = flat.element_size()
                for p, off in zip(params, fv.offsets, strict=True):
                    t = self.state[p].get(key)
                    if t is None or t.data_ptr() != base + off * size or t.shape != p.shape or not t.is_contiguous():
                        ok = False
                        break
            if ok:
                continue
            flat, views = fv.make_state(dtype=torch.float32)
            for p, view in zip(params, views, strict=True):
                old = self.state[p].get(key)
                if old is not None:
                    view.copy_(old)
                self.state[p][key] = view
            cache[key] = flat
        return cache

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
        if horizon is not None and not (_is_real_number(horizon) and horizon >= 0):
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
                    out.append(_functional().predict(p.detach(), direction, coeff))
        return out

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
                    # fp32 math (delta is fp32), rounded once to the param dtype
                    w = torch.add(p.detach().float(), delta, alpha=-group["delay"])
                    out.append(w if w.dtype == p.dtype else w.to(p.dtype))
        return out

    # ------------------------------------------------------------------ state_dict

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
        self._flat_cache.clear()
        self._predicted.clear()
        self._predicted_setting.clear()

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
        self.__dict__.setdefault("_flat_cache", {})
        self.__dict__.setdefault("_arena_warned", False)
        for group in self.param_groups:
            for key, value in DELAY_DEFAULTS.items():
                group.setdefault(key, value)


class _FusedLoader:
    """Callable that imports ``triton_kernels.<family>`` on its first call.

    Importing Triton costs seconds and needs TRITON_INTERPRET on CPU, so CPU users of the
    reference path never pay for it.
    """

    _cache: dict[str, Callable[..., Any]] = {}

    def __init__(self, family: str) -> None:
        self.family = family

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._cache.get(self.family)
        if fn is None:
            try:
                module = __import__(f"triton_kernels.{self.family}", fromlist=["_"])
            except ImportError as exc:
                raise RuntimeError(
                    f"fused update needs triton_kernels.{self.family} and triton ({exc}); "
                    "install triton==3.6.0 or pass fused=False"
                ) from exc
            fn = getattr(module, f"fused_{self.family}_update")
            self._cache[self.family] = fn
        return fn(*args, **kwargs)

