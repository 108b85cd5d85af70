"""state_dict conversion of an engine optimizer: torch.optim's format in both directions.

Why: a torch.optim state_dict must load into an engine optimizer and step to the same
result, and the other way round. Two conventions differ and are converted here: state is
fp32 for bf16/fp16 params (torch keeps it in the param dtype; a deliberate improvement,
converted back to fp32 on load from torch's values) and Adam's step count sits beside the
param (torch keeps it on the CPU; older checkpoints keep a Python number). Options missing
from an older or a torch state_dict are filled from this optimizer's defaults.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.optim import functional
from engine.optim.dispatch import paths
from engine.optim.options import DELAY_DEFAULTS

__all__ = ["StateDictIO"]


class StateDictIO:
    """load_state_dict/__setstate__ of :class:`~engine.optim.base.DelayOptimizer` (a mixin)."""

    _family: str
    param_groups: list[dict[str, Any]]
    state: Any
    _bindings: dict[int, Any]
    _auto: dict[int, Any]
    _predicted: dict[Tensor, Tensor]
    _predicted_setting: dict[Tensor, Any]

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
        point at the replaced state (the next step re-creates them from the loaded values).
        A Tensor lr the groups held keeps its object and address, the loaded value copied in
        (a device lr read by the kernels, a captured step, a scheduler hold that tensor)."""
        held = [g.get("lr") for g in self.param_groups]
        super().load_state_dict(state_dict)  # calls __setstate__: missing keys are filled
        for group, lr in zip(self.param_groups, held, strict=True):
            new = group.get("lr")
            if isinstance(lr, Tensor) and isinstance(new, Tensor) and new is not lr \
                    and new.numel() == lr.numel():
                lr.copy_(new.detach().reshape(lr.shape))
                group["lr"] = lr
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
                    if key in ("step", "mu_product"):
                        # older checkpoints keep Adam's step as a Python number
                        step = value if isinstance(value, Tensor) else torch.tensor(float(value))
                        self.state[p][key] = step.detach().to(device=p.device, dtype=torch.float32).clone()
                    elif (isinstance(value, Tensor) and value.is_floating_point()
                          and not value.is_sparse and not torch.is_complex(p)):
                        # the group's state_dtype (as loaded) decides the moments' dtype:
                        # a checkpoint saved with another state_dtype, or torch's, converts
                        of = getattr(self, "_state_dtype_of", None)  # (BasisRotation: none)
                        dtype = of(group, p.dtype, key) if of else functional.state_dtype(p.dtype)
                        self.state[p][key] = value.detach().to(device=p.device, dtype=dtype).clone()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_predicted", {})
        self.__dict__.setdefault("_predicted_setting", {})
        self.__dict__.setdefault("_bindings", {})
        self.__dict__.setdefault("_bind_order", [])
        self.__dict__.setdefault("_auto", {})
        self.__dict__.setdefault("_checked", {})
        self.__dict__.setdefault("last_step_predicted", False)
        self.__dict__.setdefault("_paths", paths(self._family))
        self.__dict__.setdefault("_fuse_cache", {})
        # a state_dict from torch.optim (or an older engine version) lacks some options
        # (the delay options; torch's flags in older checkpoints): this optimizer's defaults
        defaults = self.__dict__.get("defaults", DELAY_DEFAULTS)
        for group in self.param_groups:
            for key, value in defaults.items():
                group.setdefault(key, value)
        for group in self.param_groups:
            for p in group["params"]:
                entry = self.state.get(p)
                for key in ("step", "mu_product"):  # NAdam keeps both
                    if entry and key in entry and not isinstance(entry[key], Tensor):
                        entry[key] = torch.tensor(float(entry[key]), dtype=torch.float32, device=p.device)
