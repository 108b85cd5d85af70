"""Fused momentum-SGD step: one pass over a flat buffer (or one tensor) per call.

The update itself is a ``@triton.jit`` body (``_sgd_body``) that two private kernels call:
``_sgd_kernel`` over one tensor, and ``_sgd_multi_kernel`` over the segments of a
``SegmentTable`` (many tensors or flat buckets of one param group, one launch; see
triton_kernels/multi.py), so both compute the same bits. :func:`launch_sgd` is the one public
entry point: it takes a tensor or a ``SegmentTable``.

Why a kernel: torch's single-tensor SGD with weight decay, momentum and the delay mitigations
reads and writes the weights, gradient and buffers several times (one pass per torch op);
this kernel reads w, g and the momentum buffer once and writes the new weights, the buffer
and, when asked, the predicted weights (LWP / SpecTrain / "momentum" look-ahead) and
PipeMare's discrepancy buffer in the same pass; the delay-compensated gradient (DC) reads the
same one load of that buffer. The math is
``engine.optim.functional.sgd_update`` op for op (same order of roundings, fp32 arithmetic,
bf16/fp16 weights rounded to nearest even once on store); see that function for the rules.

Every feature is a ``tl.constexpr`` flag, so a launch compiles only what it uses. AMP's
``grad_scale`` and ``found_inf`` are read on the device: an overflowed step writes nothing and
never synchronizes with the host.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl
from torch import Tensor

from engine.triton_kernels._launch import (
    GPU_WARPS,
    block_offsets,
    cast_rne,
    check_launchable,
    default_block,
    grid_for,
    check_lr_tensor,
    interpreting,
    load_and_decay,
    load_lr,
    placeholder,
)
from engine.triton_kernels.multi import (
    SegmentTable,
    check_roles,
    launch_segments,
    segment_offsets,
    segment_ptr,
)
from engine.update_rules import check_dc, spike_coeffs, validate_sgd_args

__all__ = ["launch_sgd", "SGD_ROLES"]


@triton.jit
def _sgd_body(
    param_ptr, grad_ptr, buf_ptr, pred_ptr, delta_ptr, scale_ptr, offs, mask,
    lr, momentum, keep, weight_decay, sc_a, sc_b, pred_coeff, gamma, keep_gamma, dc_coef,
    WEIGHT_DECAY: tl.constexpr, MOMENTUM: tl.constexpr, INIT: tl.constexpr,
    NESTEROV: tl.constexpr, SC: tl.constexpr, MAXIMIZE: tl.constexpr, PREDICT: tl.constexpr,
    DELTA: tl.constexpr, DC: tl.constexpr, SCALE: tl.constexpr,
):
    """The update of the elements ``offs`` (masked): what both the single-tensor and the
    multi-tensor kernel run."""
    # delta is read once: DC's estimate, then updated; SGD's decay is always L2 (coupled)
    w, g, _w_old, d = load_and_decay(param_ptr, grad_ptr, scale_ptr, delta_ptr, offs, mask,
                                     weight_decay, 1.0, dc_coef, SCALE, MAXIMIZE, WEIGHT_DECAY,
                                     False, DELTA, DC)

    if MOMENTUM:
        if INIT:
            v = g
        else:
            # fp32 math also for a bf16/fp16 buffer (state_dtype): loaded up, rounded once
            v = tl.load(buf_ptr + offs, mask=mask).to(tl.float32)
            v = v * momentum + keep * g
        v_st = cast_rne(v, buf_ptr.dtype.element_ty)
        tl.store(buf_ptr + offs, v_st, mask=mask)
        # One explicit fused multiply-add each, not left to the compiler: on a GPU it
        # contracts a*b + c*d into fma(c, d, a*b) or fma(a, b, c*d) as it likes, and did so
        # differently for the two lines (SC with delay 1 came out 1 ulp off Nesterov on a
        # GPU). Written the same way, SC_1 (sc_a = m, sc_b = 1: g * 1 is exact) is
        # Nesterov bit for bit on every device; the interpreter rounds fma as a*b, then + c.
        if SC:
            upd = tl.fma(sc_a, v, g * sc_b)
        elif NESTEROV:
            upd = tl.fma(momentum, v, g)
        else:
            upd = v
        # the update uses v unrounded (as torch's fused kernels); the prediction the buffer
        # as stored, so an on-demand prediction from the state reproduces it (an fp32
        # buffer: the same value)
        direction = v_st.to(tl.float32)
    else:
        upd = g
        direction = g

    w_new = cast_rne(w - lr * upd, param_ptr.dtype.element_ty)
    tl.store(param_ptr + offs, w_new, mask=mask)

    if PREDICT or DELTA:
        # derived buffers use the weights as stored, as the reference does
        w_st = w_new.to(tl.float32)
        if PREDICT:
            pred = cast_rne(w_st - pred_coeff * direction, pred_ptr.dtype.element_ty)
            tl.store(pred_ptr + offs, pred, mask=mask)
        if DELTA:
            d = d * gamma + keep_gamma * (w_st - w)
            tl.store(delta_ptr + offs, d, mask=mask)


@triton.jit
def _sgd_kernel(
    param_ptr, grad_ptr, buf_ptr, pred_ptr, delta_ptr, scale_ptr, inf_ptr, lr_ptr, aux_ptr,
    n, lr, momentum, keep, weight_decay, sc_a, sc_b, pred_coeff, gamma, keep_gamma, dc_coef,
    BLOCK: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr,
    MOMENTUM: tl.constexpr,
    INIT: tl.constexpr,
    NESTEROV: tl.constexpr,
    SC: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    PREDICT: tl.constexpr,
    DELTA: tl.constexpr,
    DC: tl.constexpr,
    SCALE: tl.constexpr,
    CHECK_INF: tl.constexpr,
    LR_PTR: tl.constexpr,
):
    offs, mask = block_offsets(n, inf_ptr, BLOCK, CHECK_INF)
    lr, pred_coeff = load_lr(lr, pred_coeff, lr_ptr, aux_ptr, LR_PTR, PREDICT)
    _sgd_body(param_ptr, grad_ptr, buf_ptr, pred_ptr, delta_ptr, scale_ptr, offs, mask,
             lr, momentum, keep, weight_decay, sc_a, sc_b, pred_coeff, gamma, keep_gamma,
             dc_coef, WEIGHT_DECAY, MOMENTUM, INIT, NESTEROV, SC, MAXIMIZE, PREDICT, DELTA, DC,
             SCALE)


#: operand rows of the multi-tensor table (triton_kernels/multi.py), in order
SGD_ROLES = ("param", "grad", "buf", "pred", "delta")
_SGD_DTYPES = {"param": "PARAM_T", "grad": "GRAD_T", "buf": "BUF_T", "pred": "PRED_T",
               "delta": "DELTA_T"}


@triton.jit
def _sgd_multi_kernel(
    meta_ptr, chunk_ptr, nseg, scale_ptr, inf_ptr, lr_ptr, aux_ptr,
    lr, momentum, keep, weight_decay, sc_a, sc_b, pred_coeff, gamma, keep_gamma, dc_coef,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    PARAM_T: tl.constexpr,
    GRAD_T: tl.constexpr,
    BUF_T: tl.constexpr,
    PRED_T: tl.constexpr,
    DELTA_T: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr,
    MOMENTUM: tl.constexpr,
    INIT: tl.constexpr,
    NESTEROV: tl.constexpr,
    SC: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    PREDICT: tl.constexpr,
    DELTA: tl.constexpr,
    DC: tl.constexpr,
    SCALE: tl.constexpr,
    CHECK_INF: tl.constexpr,
    LR_PTR: tl.constexpr,
):
    seg, offs, mask = segment_offsets(meta_ptr, chunk_ptr, nseg, inf_ptr, 5, BLOCK, ALIGNED,
                                      CHECK_INF)
    lr, pred_coeff = load_lr(lr, pred_coeff, lr_ptr, aux_ptr, LR_PTR, PREDICT)
    _sgd_body(segment_ptr(meta_ptr, nseg, seg, 0, PARAM_T, ALIGNED),
             segment_ptr(meta_ptr, nseg, seg, 1, GRAD_T, ALIGNED),
             segment_ptr(meta_ptr, nseg, seg, 2, BUF_T, ALIGNED),
             segment_ptr(meta_ptr, nseg, seg, 3, PRED_T, ALIGNED),
             segment_ptr(meta_ptr, nseg, seg, 4, DELTA_T, ALIGNED),
             scale_ptr, offs, mask,
             lr, momentum, keep, weight_decay, sc_a, sc_b, pred_coeff, gamma, keep_gamma,
             dc_coef, WEIGHT_DECAY, MOMENTUM, INIT, NESTEROV, SC, MAXIMIZE, PREDICT, DELTA, DC,
             SCALE)


@functools.lru_cache(maxsize=256)  # a pure function of numbers: steady steps reuse it
def _sgd_args(*, lr: float, momentum: float, dampening: float, weight_decay: float,
              nesterov: bool, maximize: bool, init_momentum: bool, sc_delay: int,
              predict: bool, predict_coeff: float, delta: bool, delta_gamma: float,
              dc_coeff: float, scale: bool, check_inf: bool,
              lr_ptr: bool = False) -> tuple[tuple[float, ...], dict]:
    """The kernels' float arguments and constexpr flags (shared by both launches); with
    ``lr_ptr`` the kernel loads lr and the prediction coefficient from device tensors."""
    use_momentum = momentum != 0
    sc = use_momentum and sc_delay > 0
    sc_a, sc_b = spike_coeffs(momentum, sc_delay) if sc else (0.0, 0.0)
    sc_b *= 1 - dampening  # the spike term's (1 - d), as the reference (ALGORITHMS.md)
    scalars = (float(lr), float(momentum), float(1 - dampening), float(weight_decay),
               float(sc_a), float(sc_b), float(predict_coeff), float(delta_gamma),
               float(1 - delta_gamma), float(dc_coeff))
    flags = dict(
        WEIGHT_DECAY=weight_decay != 0,
        MOMENTUM=use_momentum,
        # flags that change no code are canonicalised, so that no launch compiles a
        # duplicate variant (e.g. at the second step of momentum-free SGD)
        INIT=use_momentum and bool(init_momentum),
        NESTEROV=use_momentum and not sc and bool(nesterov),
        SC=sc,
        MAXIMIZE=bool(maximize),
        PREDICT=predict,
        DELTA=delta,
        DC=dc_coeff != 0,
        SCALE=scale,
        CHECK_INF=check_inf,
        LR_PTR=lr_ptr,
        num_warps=1 if interpreting() else GPU_WARPS,
    )
    return scalars, flags


def _lr_operands(lr: float | Tensor, predict_coeff: float | Tensor, predict: bool,
                 device: object) -> tuple[float, float, Tensor | None, Tensor | None]:
    """(lr, predict_coeff) as launch arguments, and the device tensors the kernel loads in
    their place when ``lr`` is a Tensor (None, None for a number)."""
    if not isinstance(lr, Tensor):
        if isinstance(predict_coeff, Tensor):
            raise ValueError("predict_coeff is a Tensor but lr is a number: pass both as "
                             "numbers, or lr as a Tensor and predict_coeff derived from it")
        return lr, predict_coeff, None, None
    check_lr_tensor("lr", lr, device)
    aux = None
    if predict:
        if not isinstance(predict_coeff, Tensor):
            raise ValueError(
                "with a Tensor lr, predict_coeff must be a Tensor too: the coefficient is lr "
                "times a constant (engine.update_rules.lr_product(lr, c)), so that a new lr "
                "changes no launch argument")
        check_lr_tensor("predict_coeff", predict_coeff, device)
        aux = predict_coeff.detach()
    return 0.0, 0.0, lr.detach(), aux


def launch_sgd(
    param: Tensor | SegmentTable,
    grad: object,
    momentum_buffer: object,
    *,
    lr: float | Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    init_momentum: bool,
    sc_delay: int = 0,
    predicted: object = None,
    predict_coeff: float | Tensor = 0.0,
    delta: object = None,
    delta_gamma: float = 0.0,
    dc_coeff: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    validate: bool = True,
    block: int | None = None,
) -> None:
    """The fused form of ``engine.optim.functional.sgd_update`` (same arguments and
    semantics), in one launch.

    ``param`` is one tensor (every operand contiguous, on one device), or a
    :class:`SegmentTable` with the roles :data:`SGD_ROLES`: then every segment is updated in
    one launch, and the tensor arguments (``grad``, ``momentum_buffer``, ``predicted``,
    ``delta``) only say which operands the caller means (None: not used): they must agree
    with the table's rows. ``validate=False`` skips the per-tensor checks (the optimizers
    validate once per layout). ``block``: the elements per program of a single-tensor launch
    (tests use small blocks to run several programs under the interpreter); a table fixes
    its block when it is built.

    ``lr`` may be a one-element float32 tensor on the launch's device (then
    ``predict_coeff``, when a prediction is written, a tensor derived from it): the kernel
    loads it, so an LR schedule that writes it in place changes no launch argument (a
    captured CUDA graph keeps reading the current value). The result is bitwise that of
    ``lr=float(lr)`` (and ``predict_coeff`` computed from that float on the host).
    """
    if isinstance(param, SegmentTable):
        if block is not None:
            raise ValueError("block is fixed when a SegmentTable is built; pass it there")
        _launch_table(param, lr=lr, momentum=momentum, dampening=dampening,
                      weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                      init_momentum=init_momentum, sc_delay=sc_delay, predicted=predicted,
                      predict_coeff=predict_coeff, delta=delta, delta_gamma=delta_gamma,
                      dc_coeff=dc_coeff, grad_scale=grad_scale, found_inf=found_inf,
                      validate=validate)
        return
    if not isinstance(grad, Tensor):
        raise TypeError(f"grad must be a Tensor for a one-tensor launch, got {type(grad).__name__}")
    if validate:
        validate_sgd_args(param, grad, momentum_buffer, momentum=momentum,
                          dampening=dampening, sc_delay=sc_delay, predicted=predicted,
                          delta=delta, grad_scale=grad_scale, found_inf=found_inf)
    check_dc(dc_coeff, delta, param)  # also unvalidated: DC reads the delta pointer
    use_momentum = momentum != 0
    check_launchable({"param": param, "grad": grad,
                      "momentum_buffer": momentum_buffer if use_momentum else None,
                      "predicted": predicted, "delta": delta})
    lr, predict_coeff, lr_t, aux = _lr_operands(lr, predict_coeff, predicted is not None,
                                                param.device)
    n = param.numel()
    if n == 0:
        return
    scalars, flags = _sgd_args(
        lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
        nesterov=nesterov, maximize=maximize, init_momentum=init_momentum, sc_delay=sc_delay,
        predict=predicted is not None, predict_coeff=predict_coeff, delta=delta is not None,
        delta_gamma=delta_gamma, dc_coeff=dc_coeff, scale=grad_scale is not None,
        check_inf=found_inf is not None, lr_ptr=lr_t is not None)
    buf = momentum_buffer if use_momentum else None
    block = block or default_block(param, grad, buf, delta)
    _sgd_kernel[grid_for(n, block)](
        param, grad, placeholder(buf, param),
        placeholder(predicted, param), placeholder(delta, param),
        placeholder(grad_scale, param), placeholder(found_inf, param),
        placeholder(lr_t, param), placeholder(aux, param),
        n, *scalars, BLOCK=block, **flags)


def _launch_table(table: SegmentTable, *, lr: float | Tensor, momentum: float,
                  dampening: float, weight_decay: float, nesterov: bool, maximize: bool,
                  init_momentum: bool, sc_delay: int, predicted: object,
                  predict_coeff: float | Tensor,
                  delta: object, delta_gamma: float, dc_coeff: float,
                  grad_scale: Tensor | None, found_inf: Tensor | None, validate: bool) -> None:
    """:func:`launch_sgd` over every segment of ``table``."""
    use_momentum = momentum != 0
    check_roles(table, {"grad": True, "buf": use_momentum, "pred": predicted is not None,
                        "delta": delta is not None})
    if validate:
        for p, g, b, pr, d in table.segments(SGD_ROLES):
            validate_sgd_args(p, g, b, momentum=momentum, dampening=dampening,
                              sc_delay=sc_delay, predicted=pr, delta=d,
                              grad_scale=grad_scale, found_inf=found_inf)
    check_dc(dc_coeff, table.first("delta"), table.tensors("param")[0])
    lr, predict_coeff, lr_t, aux = _lr_operands(lr, predict_coeff, table.has("pred"),
                                                table.device)
    scalars, flags = _sgd_args(
        lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
        nesterov=nesterov, maximize=maximize, init_momentum=init_momentum, sc_delay=sc_delay,
        predict=table.has("pred"), predict_coeff=predict_coeff, delta=table.has("delta"),
        delta_gamma=delta_gamma, dc_coeff=dc_coeff, scale=grad_scale is not None,
        check_inf=found_inf is not None, lr_ptr=lr_t is not None)
    launch_segments(_sgd_multi_kernel, table, _SGD_DTYPES, scalars, flags, grad_scale, found_inf,
                    lr_t, aux)
