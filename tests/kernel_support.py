"""What the fused-kernel tests share: the device they run on and per-dtype tolerances."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# conftest.py sets TRITON_INTERPRET=1 only where there is no GPU; with a GPU (or an explicit
# TRITON_INTERPRET=0) the kernels are compiled and cannot take CPU tensors
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
KERNELS_RUN = DEVICE.type == "cuda" or INTERPRETED
NO_KERNELS = (
    "Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 to interpret them on CPU (here: no "
    f"GPU, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}); unset TRITON_INTERPRET "
    "and conftest.py picks the interpreter where there is no GPU"
)
# for tests that launch the kernels on DEVICE tensors (tests/optim/test_optim_fused.py)
needs_kernels = pytest.mark.skipif(not KERNELS_RUN, reason=NO_KERNELS)


@pytest.fixture(autouse=True)
def _on_device():
    # CPU: the interpreter runs the kernels on CPU tensors; on a GPU machine the kernels are
    # compiled and need CUDA tensors, so every tensor a test makes lands on DEVICE
    if not KERNELS_RUN:
        pytest.skip(NO_KERNELS)
    if DEVICE.type == "cpu":
        yield  # the default already; a device mode would slow every torch call
        return
    with torch.device(DEVICE):
        yield


def randn(n, gen):
    return torch.randn(n, generator=gen, device="cpu").to(DEVICE)


def assert_kernel_close(name, got, ref, dtype, w=None):
    """Elementwise: fp32 values to ~1e-6 relative; bf16/fp16 values to one ulp of their dtype.

    ``w`` (the reference weights) marks tensors derived from the stored weights (predicted,
    delta, last_update): a one-ulp flip of a stored weight moves them by an ulp of that
    weight, not of themselves. For the weights themselves ``w`` is their value before the
    step: w - lr * u can cancel to a value far smaller than its operands (hypothesis found
    w ~ 1 -> 0.009 with lr = 0.875), and then an ulp of the operands is the honest bound. A one-ulp flip happens only when the fp32 result sits on a
    rounding boundary (torch fuses multiply-adds on CPU, the interpreter does not), so for
    bf16/fp16 at most 1% of the elements may differ beyond fp32 agreement: a systematic
    error smaller than one ulp (a wrong step size, say) flips far more than that.
    """
    got, ref = got.float(), ref.float()
    diff = (got - ref).abs()
    tight = 8 * torch.finfo(torch.float32).eps
    rtol = tight if dtype == torch.float32 else torch.finfo(dtype).eps
    floor = tight * ref.abs().max().item()
    w_abs = 2 * w.float().abs() if w is not None else torch.zeros_like(ref)
    allowed = rtol * (ref.abs() + w_abs) + floor
    worst = (diff - allowed).argmax()
    assert (diff <= allowed).all(), (
        f"{name}: got {got[worst].item()!r}, expected {ref[worst].item()!r} at {worst.item()} "
        f"(allowed {allowed[worst].item():.3g}, {(diff > allowed).sum().item()} elements off)")
    if dtype != torch.float32:
        flipped = (diff > tight * (ref.abs() + w_abs) + floor).sum().item()
        assert flipped <= max(2, ref.numel() // 100), f"{name}: {flipped} elements one ulp off"
