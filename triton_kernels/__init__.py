"""Triton kernels of the engine: one public launcher per kernel family.

Installed as ``engine.triton_kernels`` (the folder keeps its name): a top-level
``triton_kernels`` would be ambiguous beside the Triton project's package of that name.

``launch_sgd`` (sgd.py): fused momentum-SGD step (weight decay, Nesterov, dampening,
maximize, spike compensation, weight prediction, PipeMare's delta, AMP unscale / skip).
``launch_adam`` and ``launch_nadam`` (adaptive.py, one module: they share everything around
their kernels): fused Adam / AdamW (AMSGrad, the same mitigations, on-device bias
correction; kernel in adam.py) and NAdam / NAdamW (momentum schedule computed in the kernel
from the device step and mu_product; kernel in nadam.py).
``SegmentTable`` (multi.py): the device pointer and chunk tables that let a launcher update
many tensors or flat buckets of one param group in one launch, running the same jit body as
the single-tensor kernel: pass a table where a launcher takes ``param``.
``_launch``: what the launchers share (block sizes, argument checks, bf16 rounding).

Each launcher has exactly the arguments of its reference function in
``engine.optim.functional`` (plus the keyword-only ``block``); the rules both share
(argument validation, spike-compensation coefficients, NAdam's mu) come from the torch-only
leaf ``engine.update_rules``: nothing here imports ``engine.optim``. Which path runs an
update (reference, fused, the CPU loop) is decided in ``engine.optim.dispatch`` alone. The
``@triton.jit`` kernels are private (``_sgd_kernel``). ``fused_<family>_update`` and
``fused_<family>_multi``, the entry points before the launchers took tables, still work and
warn (DeprecationWarning; to be removed in 0.4).

The modules are imported on first attribute access: Triton reads ``TRITON_INTERPRET`` when a
kernel is defined, so importing this package must not define kernels before a test's
conftest (or the user) has chosen interpreter or GPU mode.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import Any

_LAZY = {
    "launch_sgd": "engine.triton_kernels.sgd",
    "launch_adam": "engine.triton_kernels.adaptive",
    "launch_nadam": "engine.triton_kernels.adaptive",
    "SegmentTable": "engine.triton_kernels.multi",
}

#: the entry points the launchers replaced (DeprecationWarning; removal in 0.4)
_DEPRECATED = {
    "fused_sgd_update": "launch_sgd",
    "fused_adam_update": "launch_adam",
    "fused_nadam_update": "launch_nadam",
    "fused_sgd_multi": "launch_sgd",
    "fused_adam_multi": "launch_adam",
    "fused_nadam_multi": "launch_nadam",
}

__all__ = list(_LAZY)


def _deprecated(old: str, new: str) -> Any:
    launcher = __getattr__(new)

    @functools.wraps(launcher)
    def call(*args: Any, **kwargs: Any) -> Any:
        warnings.warn(f"engine.triton_kernels.{old} is deprecated and will be removed in 0.4: "
                      f"call engine.triton_kernels.{new}, which takes a tensor or a "
                      "SegmentTable", DeprecationWarning, stacklevel=2)
        return launcher(*args, **kwargs)

    call.__name__ = call.__qualname__ = old
    return call


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _DEPRECATED:
        value = _deprecated(name, _DEPRECATED[name])
    else:
        raise AttributeError(f"module 'engine.triton_kernels' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
