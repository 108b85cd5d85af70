"""The launchers of the adaptive-moment kernels: ``launch_adam`` (Adam / AdamW) and
``launch_nadam`` (NAdam / NAdamW).

Why one module: the two families share everything around their kernels (triton_kernels/
adam.py and nadam.py say why each kernel reads what it reads): the argument checks, the
choice between bias corrections formed in the kernel from a device step count and the
host's (torch's CPU-step layout), the step count advanced by a device op before the launch
(``step += (found_inf == 0)``: a write inside the kernel would race with the other programs'
reads), the table form of a launch and the constexpr flags. Each launcher takes one tensor
or a :class:`~engine.triton_kernels.multi.SegmentTable` (many tensors or flat buckets of one
param group, one launch), with exactly the arguments of its reference function in
``engine.optim.functional`` / ``functional_nadam``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

from engine.triton_kernels._launch import (
    GPU_WARPS,
    check_launchable,
    check_lr_tensor,
    default_block,
    grid_for,
    interpreting,
    placeholder,
)
from engine.triton_kernels.adam import ADAM_DTYPES, ADAM_ROLES, _adam_kernel, _adam_multi_kernel
from engine.triton_kernels.multi import SegmentTable, check_roles, launch_segments
from engine.triton_kernels.nadam import (
    NADAM_DTYPES,
    NADAM_ROLES,
    _nadam_kernel,
    _nadam_multi_kernel,
)
from engine.update_rules import (
    check_betas,
    check_dc,
    decay_factor,
    nadam_mu,
    validate_adam_args,
    validate_nadam_args,
)

__all__ = ["launch_adam", "launch_nadam"]


def _log(beta: float) -> float:
    # beta = 0 is legal (no averaging): log -> -inf makes beta**t = exp(-inf) = 0 in-kernel
    return math.log(beta) if beta > 0 else -math.inf


def _advance_steps(steps: list[Tensor], found_inf: Tensor | None) -> None:
    """Add 1 to each step count, or, with AMP's ``found_inf``, add (found_inf == 0): on the
    device when found_inf is there (no host synchronization). One foreach op for all."""
    if found_inf is None:
        torch._foreach_add_(steps, 1)
    elif found_inf.device == steps[0].device:
        # a list of tensors, never one 0-dim tensor: Python's overload resolution turns a lone
        # 0-dim tensor into a Scalar (an .item(), a host sync that invalidated CUDA graph
        # captures of skip_update steps); the list overload reads it on
        # the device
        inc = (found_inf.reshape(()) == 0).to(steps[0].dtype)
        torch._foreach_add_(steps, [inc] * len(steps))
    elif found_inf.item() == 0:
        torch._foreach_add_(steps, 1)


def _advance_mu(step: Tensor, mu_product: Tensor, found_inf: Tensor | None, beta1: float,
                momentum_decay: float) -> None:
    """NAdam's scalar state on the device: step += (no overflow); mu_product *= mu_t (1 on an
    overflow)."""
    _advance_steps([step], found_inf)
    mu_t = beta1 * (1.0 - 0.5 * torch.pow(0.96, step.double() * momentum_decay))
    if found_inf is not None:
        mu_t = torch.where(found_inf.reshape(()) == 0, mu_t, torch.ones_like(mu_t))
    mu_product.mul_(mu_t.float())  # fp32 times fp32 mu, as the reference's mu_product *= mu


def _flags(*, weight_decay: float, decoupled: bool, maximize: bool, last: bool, predict: bool,
           delta: bool, dc_coeff: float, scale: bool, check_inf: bool, device_step: bool,
           beta1: float, lr_ptr: bool) -> dict[str, Any]:
    """The constexpr flags both kernels take (flags that change no code are canonicalised,
    so that no launch compiles a duplicate variant)."""
    return dict(
        WEIGHT_DECAY=weight_decay != 0,
        DECOUPLED=weight_decay != 0 and bool(decoupled),
        MAXIMIZE=bool(maximize),
        LAST=last,
        PREDICT=predict,
        DELTA=delta,
        DC=dc_coeff != 0,
        SCALE=scale,
        CHECK_INF=check_inf,
        DEVICE_STEP=bool(device_step),
        LERP_SMALL=abs(1 - beta1) < 0.5,
        LR_PTR=lr_ptr,
        num_warps=1 if interpreting() else GPU_WARPS,
    )


def _lr_operands(lr: float | Tensor, weight_decay: float, decoupled: bool, device: object,
                 host_path: bool = False) -> tuple[float, Tensor | None, Tensor | None]:
    """``lr`` as a launch argument, and, for a Tensor lr, the device tensors the kernel loads
    in its place: lr itself and AdamW's decay 1 - lr * wd (``decay_factor``: the bits the
    float path computes on the host). The host path (a CPU step count: the host forms the
    coefficients, reading the step) reads a Tensor lr on the host too."""
    if not isinstance(lr, Tensor):
        return lr, None, None
    check_lr_tensor("lr", lr, device)
    if host_path:
        return float(lr.detach()), None, None
    aux = decay_factor(lr, weight_decay) if weight_decay != 0 and decoupled else None
    return 0.0, lr.detach(), aux


def _tail(predict_horizon: float, delta_gamma: float, dc_coeff: float) -> tuple[float, ...]:
    """The last scalars of both kernels: the prediction horizon, PipeMare's gamma and
    1 - gamma, DC's coefficient."""
    return (float(predict_horizon), float(delta_gamma), float(1 - delta_gamma), float(dc_coeff))


@functools.lru_cache(maxsize=256)  # a pure function of numbers: steady steps reuse it
def _adam_args(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               decoupled: bool, amsgrad: bool, maximize: bool, sc_delay: int,
               host: tuple[float, float, float], predict_horizon: float, delta_gamma: float,
               dc_coeff: float, last: bool, predict: bool, delta: bool, scale: bool,
               check_inf: bool, device_step: bool,
               lr_ptr: bool = False) -> tuple[tuple[float, ...], dict]:
    """Adam's float arguments and constexpr flags; ``host``: the host-computed step size,
    sqrt(bc2) and SC coefficient (unused with ``device_step``)."""
    sc_a = beta1 ** int(sc_delay) if sc_delay > 0 else 0.0
    scalars = (float(lr), float(1 - beta1), float(beta2), float(1 - beta2), float(eps),
               float(weight_decay), float(1 - lr * weight_decay), _log(beta1), _log(beta2),
               *map(float, host), float(1 - sc_a), float(sc_a),
               *_tail(predict_horizon, delta_gamma, dc_coeff))
    flags = _flags(weight_decay=weight_decay, decoupled=decoupled, maximize=maximize, last=last,
                   predict=predict, delta=delta, dc_coeff=dc_coeff, scale=scale,
                   check_inf=check_inf, device_step=device_step, beta1=beta1, lr_ptr=lr_ptr)
    flags.update(AMSGRAD=bool(amsgrad), SC=sc_delay > 0)
    return scalars, flags


def _nadam_args(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                momentum_decay: float, decoupled: bool, maximize: bool,
                host: tuple[float, float, float], predict_horizon: float, delta_gamma: float,
                dc_coeff: float, last: bool, predict: bool, delta: bool, scale: bool,
                check_inf: bool, device_step: bool,
                lr_ptr: bool = False) -> tuple[tuple[float, ...], dict]:
    """NAdam's float arguments and constexpr flags; ``host``: the host-computed bc2 and the
    two coefficients (unused with ``device_step``)."""
    scalars = (float(lr), float(beta1), momentum_decay * math.log(0.96), _log(beta2),
               float(1 - beta1), float(beta2), float(1 - beta2), float(eps),
               float(weight_decay), float(1 - lr * weight_decay), *map(float, host),
               *_tail(predict_horizon, delta_gamma, dc_coeff))
    flags = _flags(weight_decay=weight_decay, decoupled=decoupled, maximize=maximize, last=last,
                   predict=predict, delta=delta, dc_coeff=dc_coeff, scale=scale,
                   check_inf=check_inf, device_step=device_step, beta1=beta1, lr_ptr=lr_ptr)
    return scalars, flags


def _device_step(wanted: bool | None, on_device: bool, what: str) -> bool:
    """``device_step=None`` forms the coefficients in the kernel when the scalar state lives
    on the param's device; ``False`` forces the host path (tests cover it on CPU)."""
    if wanted is None:
        return on_device
    if wanted and not on_device:
        raise ValueError(f"device_step=True needs {what} on the param's device")
    return bool(wanted)


def _table_counts(table: SegmentTable, roles: tuple[str, ...]) -> list[tuple[Tensor, ...]]:
    """The distinct one-element state rows of a table (a flat bucket's params share one), all
    on the table's device: the multi-tensor launch forms the bias corrections in the kernel."""
    rows = zip(*(table.tensors(r) for r in roles), strict=True)
    distinct = list({id(row[0]): row for row in rows}.values())
    if any(t.device != table.device for row in distinct for t in row):
        raise ValueError(f"the multi-tensor launch needs {' and '.join(roles)} on "
                         f"{table.device}; launch one tensor at a time for CPU ones")
    return distinct


def launch_adam(
    param: Tensor | SegmentTable,
    grad: object,
    exp_avg: object,
    exp_avg_sq: object,
    max_exp_avg_sq: object,
    *,
    step: object,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    sc_delay: int = 0,
    last_update: object = None,
    predicted: object = None,
    predict_horizon: float = 0.0,
    delta: object = None,
    delta_gamma: float = 0.0,
    dc_coeff: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    validate: bool = True,
    block: int | None = None,
    device_step: bool | None = None,
) -> None:
    """The fused form of ``engine.optim.functional.adam_update`` (same arguments and
    semantics), in one launch after the step count's device increment.

    ``param``: one tensor (every operand contiguous, on one device; ``step`` may be a CPU
    tensor, then the host forms the bias corrections as torch does, one host read), or a
    :class:`SegmentTable` with the roles ``ADAM_ROLES``, whose tensor arguments only say
    which operands the caller means (they must agree with the table's rows; its step counts
    must be on its device). ``block``: elements per program of a single-tensor launch (a
    table fixes its own); ``device_step``: see :func:`_device_step`. ``lr`` may be a
    one-element float32 tensor on the launch's device: the kernel loads it (and AdamW's decay
    1 - lr * wd, derived from it on the device with the host's arithmetic), so an LR schedule
    that writes it in place changes no launch argument; bitwise the result of
    ``lr=float(lr)``. (The host path, a CPU step, reads it on the host.)
    """
    check_betas("Adam", beta1, beta2)
    if isinstance(param, SegmentTable):
        if block is not None or device_step is False:
            raise ValueError("a SegmentTable launch has its block fixed when it is built and "
                             "forms the bias corrections on the device")
        table = param
        check_roles(table, {"grad": True, "m": True, "v": True, "vmax": bool(amsgrad),
                            "last": last_update is not None, "pred": predicted is not None,
                            "delta": delta is not None, "step": True})
        if validate:
            for p, g, m, v, vmax, last, pred, d, st in table.segments(ADAM_ROLES):
                validate_adam_args(p, g, m, v, vmax, st, amsgrad=amsgrad, sc_delay=sc_delay,
                                   last_update=last, predicted=pred, delta=d,
                                   grad_scale=grad_scale, found_inf=found_inf)
        check_dc(dc_coeff, table.first("delta"), table.tensors("param")[0])
        steps = [row[0] for row in _table_counts(table, ("step",))]
        lr, lr_t, aux = _lr_operands(lr, weight_decay, decoupled, table.device)
        _advance_steps(steps, found_inf)
        scalars, flags = _adam_args(
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            decoupled=decoupled, amsgrad=amsgrad, maximize=maximize, sc_delay=sc_delay,
            host=(0.0, 0.0, 0.0), predict_horizon=predict_horizon, delta_gamma=delta_gamma,
            dc_coeff=dc_coeff, last=table.has("last"), predict=table.has("pred"),
            delta=table.has("delta"), scale=grad_scale is not None,
            check_inf=found_inf is not None, device_step=True, lr_ptr=lr_t is not None)
        launch_segments(_adam_multi_kernel, table, ADAM_DTYPES, scalars, flags, grad_scale,
                        found_inf, lr_t, aux)
        return
    if validate:  # the optimizers validate once per layout and pass validate=False
        validate_adam_args(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step,
                           amsgrad=amsgrad, sc_delay=sc_delay, last_update=last_update,
                           predicted=predicted, delta=delta, grad_scale=grad_scale,
                           found_inf=found_inf)
    check_dc(dc_coeff, delta, param)  # also unvalidated: DC reads the delta pointer
    if not isinstance(step, Tensor):  # (validate=False skipped the check)
        raise TypeError(f"step must be a one-element float32 tensor, got {step!r}")
    if step.device != param.device and step.device.type != "cpu":
        raise ValueError(f"step is on {step.device}; it must be on the CPU or on the param's "
                         f"device {param.device}")
    check_launchable({"param": param, "grad": grad, "exp_avg": exp_avg,
                      "exp_avg_sq": exp_avg_sq,
                      "max_exp_avg_sq": max_exp_avg_sq if amsgrad else None,
                      "last_update": last_update, "predicted": predicted, "delta": delta})
    device_step = _device_step(device_step, step.device == param.device, "step")
    lr, lr_t, aux = _lr_operands(lr, weight_decay, decoupled, param.device, not device_step)

    _advance_steps([step], found_inf)

    host = (0.0, 0.0, 0.0)
    if not device_step:
        # torch's non-capturable path: Python floats from the step value
        sc_a = beta1 ** int(sc_delay) if sc_delay > 0 else 0.0
        t = step.item()
        bias_correction1 = 1 - beta1**t
        host = (lr / bias_correction1, (1 - beta2**t) ** 0.5, sc_a / bias_correction1)

    n = param.numel()
    if n == 0:
        return
    scalars, flags = _adam_args(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        decoupled=decoupled, amsgrad=amsgrad, maximize=maximize, sc_delay=sc_delay, host=host,
        predict_horizon=predict_horizon, delta_gamma=delta_gamma, dc_coeff=dc_coeff,
        last=last_update is not None, predict=predicted is not None, delta=delta is not None,
        scale=grad_scale is not None, check_inf=found_inf is not None, device_step=device_step,
        lr_ptr=lr_t is not None)
    # the moments share exp_avg's dtype; last_update and delta stay fp32 under a bf16
    # state_dtype (engine.update_rules.moment_dtypes)
    block = block or default_block(param, grad, exp_avg, last_update, delta)
    _adam_kernel[grid_for(n, block)](
        param, grad, exp_avg, exp_avg_sq,
        placeholder(max_exp_avg_sq if amsgrad else None, param),
        placeholder(last_update, param), placeholder(predicted, param),
        placeholder(delta, param), placeholder(grad_scale, param),
        placeholder(found_inf, param), step if device_step else param,
        placeholder(lr_t, param), placeholder(aux, param),
        n, *scalars, BLOCK=block, **flags)


def launch_nadam(
    param: Tensor | SegmentTable,
    grad: object,
    exp_avg: object,
    exp_avg_sq: object,
    mu_product: object,
    *,
    step: object,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    momentum_decay: float,
    decoupled: bool,
    maximize: bool,
    last_update: object = None,
    predicted: object = None,
    predict_horizon: float = 0.0,
    delta: object = None,
    delta_gamma: float = 0.0,
    dc_coeff: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    validate: bool = True,
    block: int | None = None,
    device_step: bool | None = None,
) -> None:
    """The fused form of ``engine.optim.functional_nadam.nadam_update`` (same arguments and
    semantics): ``step`` and ``mu_product`` advanced by device ops, then one launch.

    ``param``: one tensor (``step`` and ``mu_product`` may live on the CPU: then the host
    forms the coefficients from them exactly as torch does, one host read), or a
    :class:`SegmentTable` with the roles ``NADAM_ROLES`` (as :func:`launch_adam`); ``lr`` a
    number or a device tensor, as for :func:`launch_adam`.
    """
    check_betas("NAdam", beta1, beta2)
    if isinstance(param, SegmentTable):
        if block is not None or device_step is False:
            raise ValueError("a SegmentTable launch has its block fixed when it is built and "
                             "forms the coefficients on the device")
        table = param
        check_roles(table, {"grad": True, "m": True, "v": True, "last": last_update is not None,
                            "pred": predicted is not None, "delta": delta is not None,
                            "step": True, "prod": True})
        if validate:
            for p, g, m, v, last, pred, d, st, prod in table.segments(NADAM_ROLES):
                validate_nadam_args(p, g, m, v, prod, st, last_update=last, predicted=pred,
                                    delta=d, grad_scale=grad_scale, found_inf=found_inf)
        check_dc(dc_coeff, table.first("delta"), table.tensors("param")[0])
        counts = _table_counts(table, ("step", "prod"))
        lr, lr_t, aux = _lr_operands(lr, weight_decay, decoupled, table.device)
        for s, prod in counts:
            _advance_mu(s, prod, found_inf, beta1, momentum_decay)
        scalars, flags = _nadam_args(
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            momentum_decay=momentum_decay, decoupled=decoupled, maximize=maximize,
            host=(0.0, 0.0, 0.0), predict_horizon=predict_horizon, delta_gamma=delta_gamma,
            dc_coeff=dc_coeff, last=table.has("last"), predict=table.has("pred"),
            delta=table.has("delta"), scale=grad_scale is not None,
            check_inf=found_inf is not None, device_step=True, lr_ptr=lr_t is not None)
        launch_segments(_nadam_multi_kernel, table, NADAM_DTYPES, scalars, flags, grad_scale,
                        found_inf, lr_t, aux)
        return
    if validate:
        validate_nadam_args(param, grad, exp_avg, exp_avg_sq, mu_product, step,
                            last_update=last_update, predicted=predicted, delta=delta,
                            grad_scale=grad_scale, found_inf=found_inf)
    check_dc(dc_coeff, delta, param)  # also unvalidated: DC reads the delta pointer
    if not isinstance(step, Tensor) or not isinstance(mu_product, Tensor):
        raise TypeError("step and mu_product must be one-element float32 tensors, got "
                        f"{step!r} and {mu_product!r}")
    check_launchable({"param": param, "grad": grad, "exp_avg": exp_avg,
                      "exp_avg_sq": exp_avg_sq, "last_update": last_update,
                      "predicted": predicted, "delta": delta})
    device_step = _device_step(
        device_step, step.device == param.device and mu_product.device == param.device,
        "step and mu_product")
    lr, lr_t, aux = _lr_operands(lr, weight_decay, decoupled, param.device, not device_step)
    bc2 = coef_g = coef_m = 0.0
    if device_step:
        _advance_mu(step, mu_product, found_inf, beta1, momentum_decay)
    else:
        if found_inf is not None and found_inf.item() != 0:
            return  # an overflowed AMP step changes nothing, state included
        # the scalar state advances with the reference's ops, so it stays bit-identical to it
        step += 1
        t = step.item()
        mu = nadam_mu(beta1, momentum_decay, t)
        mu_next = nadam_mu(beta1, momentum_decay, t + 1)
        mu_product *= mu
        prod = mu_product.item()
        coef_g = -lr * (1.0 - mu) / (1.0 - prod)
        coef_m = (-lr * mu_next) / (1.0 - prod * mu_next)
        bc2 = 1 - beta2**t

    n = param.numel()
    if n == 0:
        return
    scalars, flags = _nadam_args(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        momentum_decay=momentum_decay, decoupled=decoupled, maximize=maximize,
        host=(bc2, coef_g, coef_m), predict_horizon=predict_horizon, delta_gamma=delta_gamma,
        dc_coeff=dc_coeff, last=last_update is not None, predict=predicted is not None,
        delta=delta is not None, scale=grad_scale is not None,
        check_inf=bool(device_step) and found_inf is not None, device_step=device_step,
        lr_ptr=lr_t is not None)
    block = block or default_block(param, grad, exp_avg)
    _nadam_kernel[grid_for(n, block)](
        param, grad, exp_avg, exp_avg_sq,
        placeholder(last_update, param), placeholder(predicted, param),
        placeholder(delta, param), placeholder(grad_scale, param),
        placeholder(found_inf if device_step else None, param),
        step if device_step else param, mu_product if device_step else param,
        placeholder(lr_t, param), placeholder(aux, param),
        n, *scalars, BLOCK=block, **flags)
