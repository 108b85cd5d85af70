"""Which implementation runs an update: the plain-torch reference or the fused Triton kernel.

The one module of ``engine.optim`` that names ``engine.triton_kernels``. The fused kernels are
imported on first use: importing Triton costs seconds and, on CPU, needs
``TRITON_INTERPRET=1``, so users of the reference path never pay for it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["kernels", "multi_kernel", "use_fused", "FUSED_DTYPES"]

#: param dtypes the fused kernels read and write; other dtypes take the reference path
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_MODULES: dict[str, Any] = {}
#: one-element operands of the multi-tensor kernels (the rest sweep a tensor each)
_SCALAR_ROLES = ("step", "prod")


def _module(family: str) -> Any:
    module = _MODULES.get(family)
    if module is None:
        try:
            module = importlib.import_module(f"engine.triton_kernels.{family}")
        except ImportError as exc:
            raise RuntimeError(
                f"fused update needs engine.triton_kernels.{family} and triton ({exc}); "
                "install triton==3.6.0 or pass fused=False"
            ) from exc
        _MODULES[family] = module
    return module


def _fused(family: str, multi: bool = False) -> Callable[..., Any]:
    return getattr(_module(family), f"fused_{family}_{'multi' if multi else 'update'}")


class _Fused:
    """Calls ``engine.triton_kernels.<family>.fused_<family>_update`` (``multi``: the
    multi-tensor ``fused_<family>_multi``), imported on first call."""

    def __init__(self, family: str, multi: bool = False) -> None:
        self.family = family
        self.multi = multi
        self._fn: Callable[..., Any] | None = None  # resolved at the first call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._fn
        if fn is None:
            fn = self._fn = _fused(self.family, self.multi)
        return fn(*args, **kwargs)

    def table(self, rows: dict[str, list[Tensor] | None]) -> Any:
        """A multi-tensor launch's ``SegmentTable`` over ``rows`` (role -> tensors)."""
        module = _module(self.family)
        from engine.triton_kernels.multi import SegmentTable

        roles = getattr(module, f"{self.family.upper()}_ROLES")
        return SegmentTable(roles, rows, scalar_roles=[r for r in _SCALAR_ROLES if r in roles])


_MULTI: dict[str, _Fused] = {}


def multi_kernel(family: str) -> _Fused:
    """The multi-tensor fused update of ``family`` (one launch over many tensors)."""
    fn = _MULTI.get(family)
    if fn is None:
        fn = _MULTI[family] = _Fused(family, multi=True)
    return fn


def kernels(family: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(reference, fused) update functions of ``family`` ("sgd", "adam", "nadam" or "muon";
    Muon has no fused kernel and never asks for it)."""
    from engine.optim import functional, functional_muon, functional_nadam

    module = {"nadam": functional_nadam, "muon": functional_muon}.get(family, functional)
    return getattr(module, f"{family}_update"), _Fused(family)


def use_fused(group: dict[str, Any], tensors: Sequence[Tensor]) -> bool:
    """``fused=None``: Triton when every tensor is on CUDA; True/False force it."""
    fused = group["fused"]
    if fused is None:
        return len(tensors) > 0 and all(t.device.type == "cuda" for t in tensors)
    return bool(fused)
