"""Multi-tensor apply: one kernel launch over many tensors (or flat buckets) of one param group.

Why: a launch costs microseconds of host and GPU time whatever its size, so a group of N small
tensors updated one launch each is launch-bound. The ``*_multi_kernel`` variants of the SGD,
Adam and NAdam kernels sweep a list of *segments* (one tensor, or one flat bucket, per
segment) in one launch; their update math is the very ``@triton.jit`` body the single-tensor
kernel calls, so the two agree bit for bit.

How the kernel finds its data: a :class:`SegmentTable` holds, on the device, an int64 table
``meta`` with one row of data pointers per operand role (param, grad, state buffers, ...) and
a last row of segment sizes, plus a chunk table (segment index, start offset) with one entry
per program of BLOCK elements. A program reads its entry, loads the pointers of its segment
from ``meta`` and casts them to typed pointers (one dtype per role over the whole launch: a
group whose tensors differ in dtype is launched once per dtype signature). When every pointer
is 16-byte aligned and every size a multiple of 16 (the arena's layout, and most weight
shapes) the launch passes ``ALIGNED=True`` and the kernel tells Triton so (``multiple_of`` on
pointers, sizes and chunk starts): the same 128-bit accesses as the single-tensor kernel on
the arena path. Otherwise accesses are scalar.

Tables are built once per layout and kept by the caller (the optimizer caches one per param
group and dtype signature). New gradient tensors (autograd allocates fresh ones per step
unless they are kept) change one row: :meth:`SegmentTable.refresh` rebuilds it from a Python
list with one ``torch.tensor`` and one copy; on CUDA the staging tensor is pinned and the
copy non-blocking (torch's pinned-memory allocator does not reuse the staging block before the
copy has run), so a refresh never synchronizes with the host. The table holds no gradient
after :meth:`SegmentTable.release` (so ``zero_grad(set_to_none=True)`` frees them); a launch
refuses a table with a released role until it is refreshed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.triton_kernels._launch import check_launchable, default_block, placeholder

__all__ = ["SegmentTable", "check_roles", "launch_segments", "segment_offsets", "segment_ptr",
           "TL_DTYPES"]

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
             torch.float64: tl.float64}  # float64: one-element scalars only (a loaded step)
SWEPT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALIGN_BYTES = 16  # what Triton's divisibility hint needs for 128-bit accesses
ALIGN_NUMEL = 16  # sizes: the single-tensor launch's divisibility hint on n


@triton.jit
def segment_offsets(meta_ptr, chunk_ptr, nseg, inf_ptr, NUMEL_ROW: tl.constexpr,
                    BLOCK: tl.constexpr, ALIGNED: tl.constexpr, CHECK_INF: tl.constexpr):
    """This program's segment, element offsets (int64) and mask: the multi-tensor form of
    :func:`~engine.triton_kernels._launch.block_offsets` (found_inf != 0 masks everything)."""
    pid = tl.program_id(0)
    seg = tl.load(chunk_ptr + pid)
    start = tl.load(chunk_ptr + tl.num_programs(0) + pid)
    n = tl.load(meta_ptr + NUMEL_ROW * nseg + seg)
    if ALIGNED:
        start = tl.multiple_of(start, BLOCK)
        n = tl.multiple_of(n, 16)
    offs = start + tl.arange(0, BLOCK)
    if CHECK_INF:
        n = tl.where(tl.load(inf_ptr) == 0, n, 0)
    return seg, offs, offs < n


@triton.jit
def segment_ptr(meta_ptr, nseg, seg, ROW: tl.constexpr, T: tl.constexpr, ALIGNED: tl.constexpr):
    """The typed data pointer of role ``ROW`` of segment ``seg``."""
    ptr = tl.load(meta_ptr + ROW * nseg + seg).to(tl.pointer_type(T))
    if ALIGNED:
        # on the pointer itself: a hint on the int64 address does not survive the cast
        ptr = tl.multiple_of(ptr, 16)
    return ptr


def _host(values: list[int], device: torch.device) -> Tensor:
    """``values`` as an int64 host tensor to copy to ``device``: pinned for a CUDA device, so
    the copy can be non-blocking (torch's pinned allocator keeps the block until the copy ran)."""
    return torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")


def _staged(values: list[int], device: torch.device) -> Tensor:
    """``values`` as an int64 tensor on ``device``, copied without a host synchronization."""
    return _host(values, device).to(device, non_blocking=True)


class SegmentTable:
    """Device tables of one multi-tensor launch (see the module docstring).

    ``roles``: the kernel's operand roles in row order; ``tensors``: role -> one tensor per
    segment, or None for an operand the launch does not use (its row then repeats the param
    pointers; the kernel never reads it). ``scalar_roles`` are one-element operands (Adam's
    step count), every other role must match the param of its segment in size, be contiguous
    and non-empty. Every tensor must be on one device and each role of one dtype.
    """

    def __init__(self, roles: Sequence[str], tensors: Mapping[str, Sequence[Tensor] | None],
                 scalar_roles: Sequence[str] = (), block: int | None = None) -> None:
        unknown = set(tensors) - set(roles)
        if unknown or "param" not in tensors or "grad" not in tensors:
            raise ValueError(f"a segment table takes the roles {list(roles)} with param and "
                             f"grad; got {sorted(tensors)}")
        params = list(tensors["param"])
        if not params:
            raise ValueError("a segment table needs at least one segment")
        self.roles = tuple(roles)
        self.scalar_roles = frozenset(scalar_roles)
        self.nseg = len(params)
        self.device = params[0].device
        self.numels = [p.numel() for p in params]
        self.dtypes: dict[str, torch.dtype] = {}
        self.present = frozenset(r for r, ts in tensors.items() if ts is not None)
        self.ptrs: dict[str, list[int]] = {}
        self._aligned: dict[str, bool] = {}
        self._refs: dict[str, list[Tensor] | None] = {}
        for role in self.roles:
            ts = tensors.get(role)
            if ts is None:  # unused: the param pointers stand in, never read
                continue
            ts = list(ts)
            self.ptrs[role], self._aligned[role] = self._check(role, ts)
            self._refs[role] = ts
            self.dtypes[role] = ts[0].dtype
        for role in self.roles:
            if role not in self.present:
                self.ptrs[role] = self.ptrs["param"]
                self.dtypes[role] = self.dtypes["param"]
                self._refs[role] = None
        # the single-tensor launcher's rule over the swept operands' widths
        self.block = block or default_block(*[self._refs[r][0] for r in self.present
                                              if r not in self.scalar_roles])
        seg_of, starts = [], []
        for i, n in enumerate(self.numels):
            for s in range(0, n, self.block):
                seg_of.append(i)
                starts.append(s)
        self.nchunks = len(seg_of)
        self.chunks = _staged(seg_of + starts, self.device)
        rows = [p for r in self.roles for p in self.ptrs[r]]
        self.meta = _staged(rows + self.numels, self.device).view(len(self.roles) + 1, self.nseg)
        self._sizes_aligned = all(n % ALIGN_NUMEL == 0 for n in self.numels)

    def _check(self, role: str, ts: list[Tensor]) -> tuple[list[int], bool]:
        """Validate one role's tensors; returns their pointers and whether all are aligned."""
        if len(ts) != self.nseg:
            raise ValueError(f"segment table role {role!r} has {len(ts)} tensors for "
                             f"{self.nseg} segments")
        scalar = role in self.scalar_roles
        dtype = ts[0].dtype
        for i, t in enumerate(ts):
            if t.device != self.device:
                raise ValueError(f"segment {i} {role} is on {t.device}, segment 0's param on "
                                 f"{self.device}: one launch runs on one device")
            if t.dtype != dtype:
                raise ValueError(f"segment {i} {role} is {t.dtype}, segment 0's {dtype}: "
                                 "one launch per dtype signature")
            if scalar:
                if t.numel() != 1:
                    raise ValueError(f"segment {i} {role} must have one element, has {t.numel()}")
            elif t.numel() != self.numels[i] or t.numel() == 0:
                raise ValueError(f"segment {i} {role} has {t.numel()} elements, its param "
                                 f"{self.numels[i]} (and it must not be empty)")
        if not scalar:
            check_launchable({f"segment {i} {role}": t for i, t in enumerate(ts)})
            if dtype not in SWEPT_DTYPES:
                raise ValueError(f"{role} is {dtype}; the fused kernels take float32, bfloat16 "
                                 "and float16 tensors")
        elif dtype not in TL_DTYPES:
            raise ValueError(f"{role} is {dtype}; it must be a floating-point scalar")
        ptrs = [t.data_ptr() for t in ts]
        return ptrs, scalar or all(p % ALIGN_BYTES == 0 for p in ptrs)

    def has(self, role: str) -> bool:
        return role in self.present

    @property
    def aligned(self) -> bool:
        """Every swept pointer 16-byte aligned and every size a multiple of 16."""
        return self._sizes_aligned and all(self._aligned[r] for r in self.present)

    @property
    def ready(self) -> bool:
        """No role released since its last refresh."""
        return all(self._refs[r] is not None for r in self.present)

    def tensors(self, role: str) -> list[Tensor]:
        refs = self._refs[role]
        if refs is None:
            raise ValueError(f"segment table role {role!r} is released or unused")
        return refs

    def first(self, role: str) -> Tensor | None:
        """Segment 0's tensor of ``role``, or None when the launch does not use the role."""
        return self.tensors(role)[0] if self.has(role) else None

    def unique(self, role: str) -> list[Tensor]:
        """The distinct tensors of ``role`` (a flat bucket's params share one step count)."""
        return list({id(t): t for t in self.tensors(role)}.values())

    def release(self, role: str) -> None:
        """Drop the references to ``role``'s tensors (the pointers stay: :meth:`refresh`
        compares against them)."""
        self._refs[role] = None

    def refresh(self, role: str, ts: Sequence[Tensor], ptrs: list[int] | None = None) -> None:
        """Point ``role`` at new tensors of the same sizes, dtype and device: one row rebuilt
        and copied, only when a pointer changed. ``ptrs`` (their data pointers) skips the
        per-tensor checks: the caller vouches for sizes, dtype, device and contiguity (the
        optimizers do, for gradients: torch's ``.grad`` setter keeps them those of the param)."""
        if role not in self.present:
            raise ValueError(f"segment table role {role!r} is not used by this launch")
        ts = list(ts)
        if ptrs is None:
            ptrs, aligned = self._check(role, ts)
            if ts[0].dtype != self.dtypes[role]:
                raise ValueError(f"refreshed {role} is {ts[0].dtype}, the table's "
                                 f"{self.dtypes[role]}")
        else:
            aligned = all(p % ALIGN_BYTES == 0 for p in ptrs)
        if ptrs != self.ptrs[role]:
            row = self.roles.index(role)
            self.meta[row].copy_(_host(ptrs, self.device), non_blocking=True)
            self.ptrs[role], self._aligned[role] = ptrs, aligned
        self._refs[role] = ts

    def segments(self, roles: Sequence[str]) -> list[tuple[Tensor | None, ...]]:
        """Per segment, the tensors of ``roles`` (None for a role this launch does not use)."""
        cols = [self.tensors(r) if self.has(r) else [None] * self.nseg for r in roles]
        return list(zip(*cols, strict=True))

    def dtype_args(self, names: Mapping[str, str]) -> dict[str, object]:
        """The kernel's dtype constexprs: ``names`` maps a role to its constexpr's name."""
        return {name: TL_DTYPES[self.dtypes[role]] for role, name in names.items()}

    def grid(self) -> tuple[int]:
        return (self.nchunks,)


def check_roles(table: SegmentTable, wanted: Mapping[str, bool]) -> None:
    """The operands a multi launcher's arguments ask for (role -> used) must be the table's,
    and the table must hold every one of them (not released since its last refresh)."""
    for role, used in wanted.items():
        if used != table.has(role):
            raise ValueError(f"the launch {'uses' if used else 'does not use'} {role}, the "
                             f"segment table {'has' if table.has(role) else 'has no'} {role} row")
    if not table.ready:
        raise ValueError("the segment table has a released role: refresh it with the current "
                         "tensors before the launch")


def launch_segments(kernel: Any, table: SegmentTable, dtype_names: Mapping[str, str],
                    scalars: Sequence[float], flags: Mapping[str, Any],
                    grad_scale: Tensor | None, found_inf: Tensor | None,
                    lr: Tensor | None = None, aux: Tensor | None = None) -> None:
    """One launch of a ``*_multi_kernel`` over ``table`` (the argument order they share);
    ``lr``/``aux``: the device learning rate and its derived scalar (``load_lr``)."""
    param = table.tensors("param")[0]
    kernel[table.grid()](table.meta, table.chunks, table.nseg, placeholder(grad_scale, param),
                         placeholder(found_inf, param), placeholder(lr, param),
                         placeholder(aux, param), *scalars, BLOCK=table.block,
                         ALIGNED=table.aligned, **table.dtype_args(dtype_names), **flags)
