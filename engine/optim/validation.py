"""Validation of an engine optimizer's options and tensors, with torch.optim's conditions.

Why a module of its own: every check runs before anything changes (a bad keyword at
construction, a group edited into a bad state before a step, a sparse gradient where the
options need dense ones), names the option, its value and the group, and says what to do;
keeping them together is what keeps the conditions the same as torch's.
"""

from __future__ import annotations

import functools
import operator
import os
from typing import Any

from torch import Tensor

from engine.optim.dispatch import FUSED_DTYPES
from engine.update_rules import PARAM_DTYPES as _PARAM_DTYPES
from engine.optim.options import check_delay_options

__all__ = ["OptionChecks", "PARAM_DTYPES"]

# C-level iteration for the per-step sparse check: no Python loop over the parameters
_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")
_NOT_NONE = functools.partial(operator.is_not, None)

#: parameter dtypes the optimizers update (the reference path's, complex as torch.optim does)
PARAM_DTYPES = _PARAM_DTYPES


#: group entries that are records, not options: no check reads them (a step adds
#: ``prediction_lr``, a device tensor with a device lr: re-checking the options then would
#: read that lr on the host, in the step a capture's warm-up watches)
_RECORDS = ("prediction_lr", "initial_lr")


def _option_key(group: dict[str, Any]) -> tuple[Any, ...]:
    """The group's option values, comparable with ==, to tell whether they changed (tensors
    by identity: comparing their values would need a host read; the params list by identity,
    it is checked separately). Runs every step: a list comprehension, no generator."""
    return tuple([id(v) if isinstance(v, (Tensor, list)) else v for k, v in group.items()
                  if k not in _RECORDS])


class OptionChecks:
    """The checks of :class:`~engine.optim.base.DelayOptimizer` (a mixin; see the module
    docstring)."""

    _family: str
    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    _checked: dict[int, Any]
    _auto: dict[int, Any]
    _bindings: dict[int, Any]

    def _check_options(self, group: dict[str, Any], where: str) -> None:
        """Raise a ValueError naming the option, its value and ``where`` (the group) if any
        option of ``group`` is out of range. Subclasses extend it with their own options."""
        check_delay_options(group, where)
        if group.get("state_dtype") is not None and self._family not in ("sgd", "adam"):
            raise ValueError(
                f"{where}state_dtype={group['state_dtype']!r} is not an option of "
                f"{type(self).__name__}: only SGD, Adam and AdamW keep their moments in a "
                "chosen dtype (their kernels round the stored moments; the others' state is fp32)"
            )

    def _check_group(self, group: dict[str, Any], index: int, stepping: bool = True) -> None:
        """Options plus the checks that need the group's tensors. ``stepping=False`` (a group
        being added) leaves out what only a step needs: real (non-meta) tensors for
        ``fused=True`` where a gradient is to be applied, which torch too checks at ``step()``,
        so that a model built on the meta device can get its optimizer before ``to_empty``."""
        where = f"param_groups[{index}]: "
        self._check_options(group, where)
        for j, p in enumerate(group["params"]):
            if p.dtype not in PARAM_DTYPES:
                raise TypeError(
                    f"{where}params[{j}] is {p.dtype}; params must be float32, float64, bfloat16, "
                    "float16, complex64 or complex128"
                )
            if group.get("delay_compensation", 0.0) and p.is_complex():
                raise TypeError(
                    f"{where}delay_compensation={group['delay_compensation']!r} needs real "
                    f"params, but params[{j}] is {p.dtype} (its g * g term is elementwise on "
                    "real coordinates); set delay_compensation=0 for this param group"
                )
            if stepping and group["fused"] is True and p.device.type == "meta" and p.grad is not None:
                # torch's type and the start of its wording (its tests match it), then ours
                raise RuntimeError(
                    f"{where}`fused=True` requires all the params to be floating point Tensors "
                    f"on a device with data, but params[{j}] is on the meta device (nothing to "
                    "update there): materialize the model first, e.g. "
                    "module.to_empty(device=...), or pass fused=None"
                )
        # only tensors the kernels would update need them (other dtypes fall back to torch ops)
        if group["fused"] is True and any(
            p.device.type == "cpu" and p.dtype in FUSED_DTYPES for p in group["params"]
        ):
            if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
                raise RuntimeError(
                    f"{where}fused=True with CPU tensors runs the Triton kernels through Triton's "
                    "interpreter, which needs TRITON_INTERPRET=1 in the environment before "
                    "engine.triton_kernels is imported (export it, or set it at the top of conftest.py); "
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
        self._check_group(merged, len(getattr(self, "param_groups", [])), stepping=False)
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
            values = tuple(group.values())
            seen = checked.get(i)
            if (seen is not None and seen[0] == pkey and len(seen[2]) == len(values)
                    and all(map(operator.is_, values, seen[2]))):
                pass  # the same objects as at the last check: nothing to look at (fast path)
            else:
                okey = _option_key(group)
                if seen is None or seen[0] != pkey:
                    self._check_group(group, i)
                elif seen[1] != okey:
                    self._check_options(group, f"param_groups[{i}]: ")
                if seen is None or group.get("state_dtype") is not seen[3]:
                    self._convert_state_dtypes(group)  # first check, or the option was edited
                checked[i] = (pkey, okey, values, group.get("state_dtype"))
            bindings = self._group_bindings(i, group)
            for b in bindings:
                b.steady = False
            if len(bindings) == 1 and bindings[0].covers(params) and bindings[0].grads_in_buffer():
                # the steady state of a bound stage: dense flat gradients, checked once here
                bindings[0].steady = True
                continue
            if i in self._bindings:
                continue  # bound buckets hold dense flat gradients by construction
            if not any(map(_IS_SPARSE, filter(_NOT_NONE, map(_GRAD, params)))):
                continue
            for j, p in enumerate(params):
                g = p.grad
                if g is not None and g.is_sparse:
                    self._check_sparse(group, f"param_groups[{i}]['params'][{j}]")

    def _check_sparse(self, group: dict[str, Any], name: str) -> None:
        """Which options a sparse gradient allows (SGD: torch's plain update only)."""
        if self._family != "sgd":
            raise RuntimeError(
                f"{name} has a sparse gradient; {type(self).__name__} does not support sparse "
                "gradients, please consider torch.optim.SparseAdam instead (as torch.optim)"
            )
        on = [k for k in ("spike_compensation", "discrepancy_correction") if group[k]]
        on += ["delay_compensation"] if group.get("delay_compensation", 0.0) else []
        on += ["prediction"] if group["prediction"] is not None else []
        on += ["fused=True"] if group["fused"] else []
        on += ["AMP grad_scale/found_inf"] if getattr(self, "grad_scale", None) is not None else []
        if on:
            raise RuntimeError(
                f"{name} has a sparse gradient, which takes torch's plain sparse SGD update; "
                f"{', '.join(on)} need dense gradients (use nn.Embedding(sparse=False), or "
                "turn them off for this param group)"
            )
