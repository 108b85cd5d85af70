"""What ProcessGroupNCCL accepts, with its own error types and wording.

ProcessGroupNCCL maps each tensor to an NCCL datatype before it enqueues anything, and raises
at the call (not at ``wait()``) when it cannot: a dtype NCCL lacks (``int16``, the unsigned
types wider than a byte, ``float8_e8m0fnu``) raises ``TypeError("Input tensor data type is not
supported for NCCL process group: Short")``; a tensor that is not on the device, or a
non-contiguous one in a collective, raises ``ValueError``. ``bool`` travels as ``uint8`` (a
SUM of bools is a MAX), complex tensors as their real view, float8 as bytes (no reductions).
The twin's device is the CPU, so "CUDA" reads "CPU" in its messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: ProcessGroupNCCL's table of torch dtypes NCCL can carry (complex rides as its real view)
NCCL_DTYPES = frozenset(
    {
        torch.int8,
        torch.uint8,
        torch.float32,
        torch.float64,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bool,
        torch.bfloat16,
        torch.float8_e5m2,
        torch.float8_e4m3fn,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    }
)
FLOAT8 = frozenset(
    {torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
)

#: c10's names for dtypes, as ProcessGroupNCCL's messages print them
_C10_NAMES = {
    torch.int16: "Short",
    torch.uint16: "UInt16",
    torch.uint32: "UInt32",
    torch.uint64: "UInt64",
    torch.complex32: "ComplexHalf",
    torch.float8_e8m0fnu: "Float8_e8m0fnu",
}

REDUCE_OPS = {
    dist.ReduceOp.SUM: "SUM",
    dist.ReduceOp.AVG: "AVG",
    dist.ReduceOp.PRODUCT: "PRODUCT",
    dist.ReduceOp.MIN: "MIN",
    dist.ReduceOp.MAX: "MAX",
}
_UNSUPPORTED_OPS = {
    dist.ReduceOp.BAND: "BAND",
    dist.ReduceOp.BOR: "BOR",
    dist.ReduceOp.BXOR: "BXOR",
    dist.ReduceOp.PREMUL_SUM: "PREMUL_SUM",
}


def c10_name(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def short(t: torch.Tensor) -> str:
    """``float32[4, 3]``: how reports print a tensor."""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def check_tensor(t: object, what: str, collective: bool) -> torch.Tensor:
    """The tensor as NCCL moves it (complex: its real view), or the error ProcessGroupNCCL
    raises for it. Point-to-point tensors must be contiguous too: NCCL only warns there and
    copies raw memory, which is right only when both ends share the layout."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.is_sparse:
        raise ValueError(
            f"Tensors must be CPU and dense: the NCCL twin's device is the CPU (ProcessGroupNCCL "
            f"says 'Tensors must be CUDA and dense'); {what} is {t.device} "
            f"{'sparse' if t.is_sparse else 'dense'}"
        )
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype not in NCCL_DTYPES:
        raise TypeError(
            f"Input tensor data type is not supported for NCCL process group: {c10_name(t.dtype)}"
        )
    if not t.is_contiguous():
        kind = "collective" if collective else "point-to-point op (NCCL copies raw memory)"
        raise ValueError(f"Tensors must be contiguous: {what} of a {kind} is not")
    return t


def reduce_op(op: object, t: torch.Tensor, name: str, complex_input: bool) -> str:
    """The reduction NCCL runs for ``op`` on ``t`` (already NCCL's view), or its error."""
    for known, text in _UNSUPPORTED_OPS.items():
        if op == known:
            raise ValueError(f"Cannot use ReduceOp.{text} with NCCL (the NCCL twin)")
    found = next((text for known, text in REDUCE_OPS.items() if op == known), None)
    if found is None:
        raise ValueError(f"Unhandled ReduceOp {op!r}")
    if complex_input and found not in ("SUM", "AVG"):
        raise RuntimeError(f"{name} does not support {found} on complex tensors")
    if t.dtype in FLOAT8:
        raise RuntimeError("Float8 dtypes are not currenlty supported for NCCL reductions")
    if t.dtype == torch.bool:
        if found == "AVG":
            raise TypeError("Cannot use ReduceOp.AVG with boolean inputs")
        found = {"SUM": "MAX", "PRODUCT": "MIN"}.get(found, found)
    return found


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (what the wire carries)."""
    return t.reshape(-1).view(torch.uint8)


def fold(op: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Reduce ``parts`` (one per group rank, flat, NCCL's dtype) in group-rank order: the same
    bits on every rank and in every run. AVG is NCCL's: floats pre-multiplied by 1/n and summed,
    integers summed and divided (truncating)."""
    n = len(parts)
    work = [p.view(torch.uint8) if p.dtype == torch.bool else p for p in parts]
    floating = work[0].is_floating_point()
    if op == "AVG" and floating:
        work = [p * (1.0 / n) for p in work]
    out = work[0].clone()
    for p in work[1:]:
        if op in ("SUM", "AVG"):
            out = out + p
        elif op == "PRODUCT":
            out = out * p
        elif op == "MAX":
            out = torch.maximum(out, p)
        else:
            out = torch.minimum(out, p)
    if op == "AVG" and not floating:
        out = torch.div(out, n, rounding_mode="trunc")
    return out.view(torch.bool) if parts[0].dtype == torch.bool else out
