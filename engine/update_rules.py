"""The rules of an optimizer update that the reference math and the fused kernels share.

Why a leaf outside ``engine.optim``: the reference updates (``engine.optim.functional*``) and
the Triton launchers (``engine.triton_kernels``) must agree on the dtypes the math runs in,
on which arguments are valid, and on the coefficients computed from the options (spike
compensation's a and b, NAdam's mu). Those rules used to live in ``engine.optim.functional``,
so importing a kernel imported ``engine.optim`` and with it every optimizer, while
``engine.optim.dispatch`` imported the kernels back: the one package-level import circle
This module imports torch only; both sides import it and nothing above them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "LOW_PRECISION",
    "PARAM_DTYPES",
    "check_betas",
    "check_dc",
    "decay_factor",
    "lr_product",
    "moment_dtypes",
    "nadam_mu",
    "spike_coeffs",
    "state_dtype",
    "validate_adam_args",
    "validate_nadam_args",
    "validate_sgd_args",
]

# --------------------------------------------------------------------------- dtypes

#: param dtypes the updates take (the kernels: the first, third and fourth; see dispatch)
PARAM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16,
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


def as_compute(t: Tensor) -> Tensor:
    """The tensor in its compute dtype: fp32, fp64 and complex as they are, bf16/fp16 upcast."""
    return t if t.dtype in _NATIVE else t.float()


# --------------------------------------------------------------------------- coefficients


def spike_coeffs(momentum: float, delay: int) -> tuple[float, float]:
    """Spike-compensation coefficients (a, b) of Kosson et al. for delay ``D``.

    The applied update is ``a * v + b * g'`` with ``a = m**D`` and
    ``b = (1 - m**D) / (1 - m)`` (``b = D`` for ``m == 1``): the gradient's first ``D``
    momentum contributions, which a delayed stage would otherwise apply too late, are applied
    at once. ``D = 0`` gives (1, 0), plain momentum; ``D = 1`` gives (m, 1), Nesterov.
    """
    check_sc_delay(delay)
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"spike compensation needs 0 <= momentum <= 1, got {momentum!r}")
    return _spike_coeffs(float(momentum), int(delay))


@functools.lru_cache(maxsize=256)  # every update asks again for the same few (m, D)
def _spike_coeffs(momentum: float, delay: int) -> tuple[float, float]:
    a = momentum**delay
    if momentum == 1.0:
        return a, float(delay)
    # for D = 1 the numerator and denominator are the same float, so b == 1.0 exactly
    return a, (1.0 - a) / (1.0 - momentum)


def lr_product(lr: Tensor, c: float) -> Tensor:
    """``lr * c`` for a Tensor lr, as the host computes it for a float lr: in fp64 from lr's
    float32 value, rounded once to float32 (as a Python float is when it becomes a kernel
    argument). So a launch scalar derived from a Tensor lr has the very bits the float path
    gives it, and the kernels can load it from the device (no host read, nothing a CUDA graph
    would freeze)."""
    return (lr.detach().double() * c).float()


def decay_factor(lr: Tensor, weight_decay: float) -> Tensor:
    """``1 - lr * weight_decay`` (AdamW's decoupled decay) for a Tensor lr, with the host's
    fp64 arithmetic and one rounding to float32 (see :func:`lr_product`)."""
    return (1 - lr.detach().double() * weight_decay).float()


def nadam_mu(beta1: float, momentum_decay: float, t: float) -> float:
    """Dozat's momentum schedule as torch.optim.NAdam: ``beta1 * (1 - 0.5 * 0.96**(t * psi))``."""
    return beta1 * (1.0 - 0.5 * (0.96 ** (t * momentum_decay)))


# --------------------------------------------------------------------------- validation


def check_sc_delay(delay: Any) -> None:
    """Spike compensation's delay D: a whole number >= 0."""
    if isinstance(delay, bool) or int(delay) != delay or delay < 0:
        raise ValueError(f"spike compensation delay must be an integer >= 0, got {delay!r}")


def check_betas(family: str, beta1: float, beta2: float) -> None:
    """Adam and NAdam form beta**t and 1 / (1 - beta): both betas must lie in [0, 1)."""
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"{family} needs 0 <= beta < 1, got beta1={beta1!r}, beta2={beta2!r}")


def check_dc(coeff: float, delta: Tensor | None, param: Tensor) -> None:
    """Delay compensation needs a finite coefficient, the delta buffer and real params."""
    if coeff == 0:
        return
    if not math.isfinite(coeff):
        raise ValueError(f"dc_coeff must be finite, got {coeff!r}")
    if delta is None:
        raise ValueError(f"dc_coeff={coeff!r} needs delta (the estimate of w_t - w_(t-tau))")
    if param.is_complex():
        raise TypeError(f"delay compensation takes real params, got {param.dtype}")


def check_like(name: str, t: Tensor | None, param: Tensor,
               dtype: torch.dtype | tuple[torch.dtype, ...] | None) -> None:
    """``t`` (when given) is a Tensor shaped like ``param``, on its device, of ``dtype``."""
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.shape != param.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, param has {tuple(param.shape)}")
    if t.device != param.device:
        raise ValueError(f"{name} is on {t.device}, param is on {param.device}")
    if isinstance(dtype, tuple):
        if t.dtype not in dtype:
            raise TypeError(f"{name} must be {' or '.join(map(str, dtype))}, got {t.dtype}")
    elif dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def _check_scalar_tensor(name: str, t: Tensor | None, param: Tensor) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor) or t.numel() != 1:
        raise ValueError(f"{name} must be a one-element tensor, got {t!r}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.device != param.device:
        raise ValueError(f"{name} is on {t.device}, param is on {param.device}")


def check_common(param: Tensor, grad: Tensor, predicted: Tensor | None, delta: Tensor | None,
                 grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
    """What every family's update needs of the param, gradient and shared operands."""
    if not isinstance(param, Tensor):
        raise TypeError(f"param must be a Tensor, got {type(param).__name__}")
    if param.dtype not in PARAM_DTYPES:
        raise TypeError(f"param must be float32, float64, bfloat16, float16 or complex, got {param.dtype}")
    check_like("grad", grad, param, None)
    if grad.dtype not in PARAM_DTYPES:
        raise TypeError(f"grad must be float32, float64, bfloat16, float16 or complex, got {grad.dtype}")
    check_like("predicted", predicted, param, param.dtype)
    check_like("delta", delta, param, state_dtype(param.dtype))
    _check_scalar_tensor("grad_scale", grad_scale, param)
    _check_scalar_tensor("found_inf", found_inf, param)


def _check_count(name: str, t: object) -> None:
    if not isinstance(t, Tensor) or t.numel() != 1 or t.dtype != torch.float32:
        raise TypeError(f"{name} must be a one-element float32 tensor, got {t!r}")


def validate_sgd_args(param, grad, momentum_buffer, *, momentum, dampening, sc_delay,
                      predicted, delta, grad_scale, found_inf) -> None:
    """Raise a clear error (naming the tensor) before anything is written."""
    check_common(param, grad, predicted, delta, grad_scale, found_inf)
    if momentum < 0:
        raise ValueError(f"momentum must be >= 0, got {momentum!r}")
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError("momentum_buffer is required when momentum != 0")
        check_like("momentum_buffer", momentum_buffer, param, moment_dtypes(param.dtype))
    if sc_delay:
        spike_coeffs(momentum, sc_delay)  # validates delay and momentum range


def validate_adam_args(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, *, amsgrad,
                       sc_delay, last_update, predicted, delta, grad_scale, found_inf) -> None:
    """Raise a clear error (naming the tensor) before anything is written."""
    check_common(param, grad, predicted, delta, grad_scale, found_inf)
    sd = state_dtype(param.dtype)
    md = moment_dtypes(param.dtype)
    check_like("exp_avg", exp_avg, param, md)
    check_like("exp_avg_sq", exp_avg_sq, param, md)
    if exp_avg is None or exp_avg_sq is None:
        raise ValueError("exp_avg and exp_avg_sq are required")
    if amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("max_exp_avg_sq is required when amsgrad=True")
        check_like("max_exp_avg_sq", max_exp_avg_sq, param, md)
    check_like("last_update", last_update, param, sd)
    _check_count("step", step)
    check_sc_delay(sc_delay)


def validate_nadam_args(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                        mu_product: Tensor, step: Tensor, *, last_update: Tensor | None,
                        predicted: Tensor | None, delta: Tensor | None,
                        grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
    """Raise a clear error (naming the tensor) before anything is written."""
    check_common(param, grad, predicted, delta, grad_scale, found_inf)
    if exp_avg is None or exp_avg_sq is None:
        raise ValueError("exp_avg and exp_avg_sq are required")
    sd = state_dtype(param.dtype)
    check_like("exp_avg", exp_avg, param, sd)
    check_like("exp_avg_sq", exp_avg_sq, param, sd)
    check_like("last_update", last_update, param, sd)
    _check_count("step", step)
    _check_count("mu_product", mu_product)
