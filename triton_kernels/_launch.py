"""Helpers shared by the optimizer kernels' launchers and bodies.

Launch policy: one program per BLOCK elements of a flat buffer. On a GPU BLOCK is 1024 with 4
warps (memory-bound elementwise code; larger blocks do not help), i.e. 8 elements per
thread, two 128-bit accesses per fp32 tensor. A launch that mixes element widths (bf16/fp16
weights beside fp32 state or gradients) uses BLOCK 512, 4 elements per thread: Triton gives
each access 128 bits where it can (8 bf16, 4 fp32 elements), so at 8 elements per thread the
fp32 values computed in the bf16 layout go through shared memory (a layout conversion with a
barrier) before every fp32 store; at 4 per thread every tensor shares one layout (fp32 128-bit,
bf16/fp16 64-bit accesses, still fully coalesced) and nothing is exchanged between threads.
Under ``TRITON_INTERPRET=1`` every program instance costs milliseconds of Python, so the
launcher uses a large block there; tests can pass a small one to exercise the multi-program
path. tests/kernels/test_triton_aot.py compiles every variant for sm_90 and checks these widths.

``cast_rne`` exists because the interpreter converts fp32 to bf16 by truncation while
GPUs and torch round to nearest even: doing the rounding with integer ops gives the same bits
on both, so CPU tests check exactly what the GPU computes, and bf16 results match torch's
``Tensor.to(torch.bfloat16)``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

GPU_BLOCK = 1024
GPU_BLOCK_MIXED = 512  # 4 elements per thread at GPU_WARPS: see the module docstring
GPU_WARPS = 4
INTERPRET_BLOCK = 1 << 16


#: read once, at import, as Triton itself decides at import whether ``@triton.jit`` kernels
#: are interpreted: reading os.environ at each launch was a tenth of a small step's host time
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET at import)."""
    return _INTERPRETING


def default_block(*tensors: Tensor | None) -> int:
    """Block size for a launch that sweeps ``tensors`` (None: not accessed)."""
    if interpreting():
        return INTERPRET_BLOCK
    widths = {t.element_size() for t in tensors if t is not None}
    return GPU_BLOCK_MIXED if len(widths) > 1 else GPU_BLOCK


def check_launchable(tensors: dict[str, Tensor | None]) -> None:
    """Contiguity and device checks the kernels need on top of the reference's validation.

    The interpreter reads a strided tensor as if it were contiguous, so a strided argument
    would silently update the wrong elements: refuse it with the tensor's name.
    """
    for name, t in tensors.items():
        if t is None:
            continue
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the fused kernel (strides "
                             f"{tuple(t.stride())}); call .contiguous() or use the reference path")
        if not _INTERPRETING and t.device.type == "cpu":
            raise RuntimeError(f"{name} is a CPU tensor but TRITON_INTERPRET is not set: the "
                               "fused kernels run on CUDA tensors, or on CPU under the interpreter")


def check_lr_tensor(name: str, t: Tensor, device: object) -> None:
    """A Tensor ``lr`` (or a scalar derived from it) the kernels load: one float32 element on
    the launch's device."""
    if t.numel() != 1 or t.dtype != torch.float32 or t.device != device:
        raise ValueError(f"{name} is a Tensor the fused kernels load on the device: it must be "
                         f"one float32 element on {device}, got shape {tuple(t.shape)}, "
                         f"{t.dtype} on {t.device}")


def grid_for(n: int, block: int) -> tuple[int]:
    # integer ceil-division, not triton.cdiv: called from the host that is a constexpr
    # function call, a few microseconds per launch
    return (max(1, -(-n // block)),)


def placeholder(t: Tensor | None, fallback: Tensor) -> Tensor:
    """Pointer argument for an optional tensor; the kernel never touches it when its flag is
    off, so any valid tensor on the right device serves."""
    return fallback if t is None else t


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """Convert fp32 ``x`` to ``dtype`` rounding to nearest even, also for bf16."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        lsb = (bits >> 16) & 1
        rounded = (bits + 0x7FFF + lsb) >> 16
        # NaN must stay NaN (the carry could turn a small-payload NaN into inf): keep its top
        # half and force the quiet bit
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        out = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(dtype)
    return out


@triton.jit
def load_and_decay(param_ptr, grad_ptr, scale_ptr, delta_ptr, offs, mask, weight_decay, decay,
                   dc_coef, SCALE: tl.constexpr, MAXIMIZE: tl.constexpr,
                   WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr, DELTA: tl.constexpr,
                   DC: tl.constexpr):
    """Load w and g in fp32, unscale (AMP) and negate (maximize) g, delay-compensate it (DC:
    g += dc_coef * g * g * delta), apply the weight decay (decoupled: w *= 1 - lr * wd; else
    g += wd * w); returns (w, g, w before the decay, delta) (shared by the SGD, Adam and NAdam kernels;
    SGD passes DECOUPLED=False).
    delta is loaded here, once, when kept (``w`` stands in for it otherwise: never used)."""
    w = tl.load(param_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    if SCALE:
        g = tl.div_rn(g, tl.load(scale_ptr).to(tl.float32))
    if MAXIMIZE:
        g = -g
    d = w
    if DELTA:
        d = tl.load(delta_ptr + offs, mask=mask)
        if DC:
            g = g + dc_coef * (g * g) * d  # delay compensation (DC needs DELTA)
    w_old = w
    if WEIGHT_DECAY:
        if DECOUPLED:
            w = w * decay
        else:
            g = g + weight_decay * w
    return w, g, w_old, d


@triton.jit
def load_lr(lr, aux, lr_ptr, aux_ptr, LR_PTR: tl.constexpr, AUX: tl.constexpr):
    """The learning rate and the one launch scalar derived from it (SGD: the prediction
    coefficient; Adam/NAdam: the decoupled decay 1 - lr * wd): the launch arguments, or, with
    LR_PTR, loaded from one-element fp32 device tensors, so that a new lr value changes no
    launch argument and a CUDA graph that replays the launch reads the current one. The
    launcher derives ``aux`` from the lr tensor with the host's fp64 arithmetic (see
    engine.update_rules.lr_product), so both forms give the kernel the same bits."""
    if LR_PTR:
        lr = tl.load(lr_ptr)
        if AUX:
            aux = tl.load(aux_ptr)
    return lr, aux


@triton.jit
def block_offsets(n, inf_ptr, BLOCK: tl.constexpr, CHECK_INF: tl.constexpr):
    """This program's element offsets (int64: a stage's flat buffer can exceed 2**31
    elements) and their mask; with CHECK_INF an overflowed AMP step (found_inf != 0) masks
    every element, so nothing is read or written (shared by the SGD, Adam and NAdam kernels)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if CHECK_INF:
        n = tl.where(tl.load(inf_ptr) == 0, n, 0)
    return offs, offs < n
