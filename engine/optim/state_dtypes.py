"""Which dtypes the optimizer math runs in and its state is kept in (one concept, small).

Why a module: the reference (``engine.optim.functional``), its validation, the optimizers'
state creation and checkpoint loading must agree on these rules; ``state_dtype`` is the
default, ``moment_dtypes`` what the ``state_dtype`` option of SGD/Adam/AdamW may choose
(docs/ALGORITHMS.md, "Moments in the parameter dtype").
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LOW_PRECISION", "moment_dtypes", "state_dtype"]

_PARAM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16,
                 torch.complex64, torch.complex128)
#: dtypes the math runs in as they are (everything else is upcast to fp32)
_NATIVE = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the optimizer state (and of the update math) for params of ``dtype``:
    fp32, fp64 and complex stay as they are, bf16/fp16 compute in fp32 (bf16 moments would
    lose the small increments they accumulate). The default; see :func:`moment_dtypes`."""
    return dtype if dtype in _NATIVE else torch.float32


#: param dtypes whose moments may also be kept in the param's own dtype (``state_dtype``)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def moment_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes the moments (SGD's momentum buffer; Adam's exp_avg, exp_avg_sq,
    max_exp_avg_sq) of a ``dtype`` param may have: :func:`state_dtype`, and for bf16/fp16
    params also the param's dtype (the optimizers' ``state_dtype`` option, torch fused's
    layout). Either way the math runs in fp32 and a low-precision moment is rounded once, to
    nearest even, when stored. The project's own buffers (``delta``, ``last_update``) stay
    :func:`state_dtype`: they carry the exactness contracts of prediction and PipeMare."""
    default = state_dtype(dtype)
    return (default, dtype) if dtype in LOW_PRECISION else (default,)


def _as_f32(t: Tensor) -> Tensor:
    """The tensor in its compute dtype: fp32, fp64 and complex as they are, bf16/fp16 upcast."""
    return t if t.dtype in _NATIVE else t.float()
