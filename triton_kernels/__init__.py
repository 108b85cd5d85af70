"""Triton kernels of the engine, one module per kernel family, each with its launcher.

Installed as ``engine.triton_kernels`` (the folder keeps its name): a top-level
``triton_kernels`` would be ambiguous beside the Triton project's package of that name.

``sgd``: fused momentum-SGD step (weight decay, Nesterov, dampening, maximize, spike
compensation, weight prediction, PipeMare's delta, AMP unscale / skip).
``adam``: fused Adam / AdamW step (AMSGrad, the same mitigations, on-device bias correction).
``nadam``: fused NAdam / NAdamW step (prediction, PipeMare's delta, AMP; momentum schedule
computed in the kernel from the device step and mu_product).
``_launch``: what the launchers share (block sizes, argument checks, bf16 rounding).
``multi``: multi-tensor apply: the ``SegmentTable`` (device pointer and chunk tables) that lets
each family's ``*_multi_kernel`` update many tensors or flat buckets in one launch, running the
same jit body as the single-tensor kernel (``fused_<family>_multi``).

The launchers have exactly the signatures of the reference functions in
``engine.optim.functional``. The kernel modules are imported on first attribute access:
Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so importing this package must not
define kernels before a test's conftest (or the user) has chosen interpreter or GPU mode.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "fused_sgd_update": "engine.triton_kernels.sgd",
    "fused_adam_update": "engine.triton_kernels.adam",
    "fused_nadam_update": "engine.triton_kernels.nadam",
    "fused_sgd_multi": "engine.triton_kernels.sgd",
    "fused_adam_multi": "engine.triton_kernels.adam",
    "fused_nadam_multi": "engine.triton_kernels.nadam",
    "SegmentTable": "engine.triton_kernels.multi",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.triton_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
