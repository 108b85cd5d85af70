"""Which implementation runs an update: the plain-torch reference, the fused Triton launcher,
or (SGD on CPU) the fused C++ loop. Decided here and nowhere else.

The one module of ``engine.optim`` that names ``engine.triton_kernels``; the kernels import
nothing of ``engine.optim`` (the rules both sides share live in the leaf
``engine.update_rules``), so the arrow runs one way. The launchers are imported on first use:
importing Triton costs seconds and, on CPU, needs ``TRITON_INTERPRET=1``, so users of the
reference path never pay for it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from engine.optim import cpu_loop

__all__ = ["UpdatePaths", "paths", "use_fused", "FUSED_DTYPES"]

#: param dtypes the fused kernels read and write; other dtypes take the reference path
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: where each family's launcher lives (Adam and NAdam share one launcher module)
_LAUNCHERS = {"sgd": "sgd", "adam": "adaptive", "nadam": "adaptive"}
#: the kernel module whose ``<FAMILY>_ROLES`` name the rows of a multi-tensor table
_KERNELS = {"sgd": "sgd", "adam": "adam", "nadam": "nadam"}
#: one-element operands of the multi-tensor kernels (the rest sweep a tensor each)
_SCALAR_ROLES = ("step", "prod")


def _import(module: str) -> Any:
    try:
        return importlib.import_module(f"engine.triton_kernels.{module}")
    except ImportError as exc:
        raise RuntimeError(
            f"fused update needs engine.triton_kernels.{module} and triton ({exc}); "
            "install triton==3.6.0 or pass fused=False"
        ) from exc


class _Fused:
    """Calls ``engine.triton_kernels.launch_<family>`` (a tensor or a segment table),
    imported on first call."""

    def __init__(self, family: str) -> None:
        self.family = family
        self._fn: Callable[..., Any] | None = None  # resolved at the first call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._fn
        if fn is None:
            module = _import(_LAUNCHERS.get(self.family, self.family))
            fn = self._fn = getattr(module, f"launch_{self.family}")
        return fn(*args, **kwargs)

    def table(self, rows: dict[str, list[Tensor] | None]) -> Any:
        """A multi-tensor launch's ``SegmentTable`` over ``rows`` (role -> tensors)."""
        roles = getattr(_import(_KERNELS[self.family]), f"{self.family.upper()}_ROLES")
        table_cls = _import("multi").SegmentTable
        return table_cls(roles, rows, scalar_roles=[r for r in _SCALAR_ROLES if r in roles])


class UpdatePaths(NamedTuple):
    """The update functions of one family (same arguments): the reference, the fused
    launcher, and the CPU loop where the family has one (SGD)."""

    reference: Callable[..., Any]
    fused: _Fused
    cpu_loop: Callable[..., Any] | None

    def choose(self, fused: bool, group: dict[str, Any], predicted: Tensor | None) -> Callable[..., Any]:
        """The function of one update call. ``fused``: the group runs the kernels
        (:func:`use_fused`) and these tensors can take them. Otherwise an SGD step with a
        mitigation the CPU loop fuses (spike compensation, a prediction, PipeMare's delta)
        runs the loop, which runs the reference itself where it does not apply (not fp32,
        not contiguous, autograd, delay compensation)."""
        if fused:
            return self.fused
        if self.cpu_loop is not None and _loop_helps(group, predicted) and cpu_loop.enabled():
            return self.cpu_loop
        return self.reference


def _loop_helps(group: dict[str, Any], predicted: Tensor | None) -> bool:
    delay = group["delay"]
    keeps_delta = delay != 0 and bool(group["discrepancy_correction"]
                                      or group.get("delay_compensation", 0.0))
    return bool(group["spike_compensation"] and delay) or predicted is not None or keeps_delta


_PATHS: dict[str, UpdatePaths] = {}


def paths(family: str) -> UpdatePaths:
    """The update paths of ``family`` ("sgd", "adam", "nadam" or "muon"; Muon has no fused
    kernel and never asks for it)."""
    found = _PATHS.get(family)
    if found is None:
        from engine.optim import functional, functional_muon, functional_nadam

        module = {"nadam": functional_nadam, "muon": functional_muon}.get(family, functional)
        loop = cpu_loop.sgd_update if family == "sgd" else None
        found = _PATHS[family] = UpdatePaths(getattr(module, f"{family}_update"), _Fused(family),
                                             loop)
    return found


def use_fused(group: dict[str, Any], tensors: Sequence[Tensor]) -> bool:
    """``fused=None``: Triton when every tensor is on CUDA; True/False force it."""
    fused = group["fused"]
    if fused is None:
        return len(tensors) > 0 and all(t.device.type == "cuda" for t in tensors)
    return bool(fused)
