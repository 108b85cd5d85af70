"""The arena's value types: bucket layouts, L2 grants, and the flat view optimizers step.

Why apart from the arena: optimizers and benchmarks hold these objects (a ``FlatView`` is
what a fused optimizer step receives), so they are plain data with as little behaviour as
possible, and they must not pull in the registry or the arena class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.arena.core import ArenaError, _core_module


@dataclass(frozen=True)
class BucketInfo:
    """One flat buffer of an arena: which tensors it holds and where."""

    index: int
    device: torch.device
    dtype: torch.dtype
    group: int
    requires_grad: bool
    numel: int  # elements including padding
    nbytes: int
    offsets: tuple[int, ...]  # element offset of each tensor in the flat buffer
    numels: tuple[int, ...]
    names: tuple[str, ...]


@dataclass(frozen=True)
class L2Persistence:
    """What the device granted for an L2 access-policy window over a stage's live buffer.

    ``supported`` is False on CPU buffers and in extensions built without CUDA; ``ok`` is
    True only when the window is in place. ``granted_bytes`` is the device-wide persisting
    L2 set-aside after the request (cudaLimitPersistingL2CacheSize), or, from
    ``set_l2_window``, this window's share of it; ``reason`` says why not.
    """

    supported: bool
    ok: bool
    bucket: int
    granted_bytes: int
    window_bytes: int
    max_persisting_bytes: int
    max_window_bytes: int
    hit_ratio: float
    reason: str


@dataclass(eq=False)
class FlatView:
    """The flat buffers behind one bucket, for optimizers that update it in one launch.

    ``param`` is the flat live buffer (padding included), ``grad`` the flat gradient buffer
    (None for requires_grad=False buckets); the i-th parameter is
    ``param[offsets[i] : offsets[i] + numels[i]]``. Obtain one with :func:`flat_buffers_for`.
    """

    param: torch.Tensor
    grad: torch.Tensor | None
    offsets: list[int]
    numels: list[int]
    params: tuple[torch.Tensor, ...]
    shapes: tuple[torch.Size, ...]
    alignment: int
    _grad_views: tuple[torch.Tensor, ...] = field(default=(), repr=False)
    _grad_ptrs: tuple[int, ...] = field(default=(), repr=False)

    def grads_are_views(self) -> bool:
        """True when every ``p.grad`` is the view into ``grad`` (so ``grad`` is complete)."""
        if self.grad is None:
            return True
        for p, ptr in zip(self.params, self._grad_ptrs, strict=False):
            g = p.grad
            if g is None or g.data_ptr() != ptr:
                return False
        return True

    def rebind_grads(self) -> None:
        """Make every ``p.grad`` the view into ``grad``: copy foreign gradients in, and
        treat a missing gradient (None, e.g. after ``zero_grad(set_to_none=True)`` or a
        parameter that took no part in the loss) as zero."""
        if self.grad is None:
            return
        _rebind(self.params, self._grad_views, self._grad_ptrs)

    def make_state(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A zero flat buffer with this bucket's layout, plus one view per parameter.

        For optimizer state (momentum, Adam moments) that a fused kernel sweeps together
        with ``param`` and ``grad``: element i of the state belongs to element i of the
        weights. The base is aligned to the arena's alignment in bytes.
        """
        if not dtype.is_floating_point:
            raise ArenaError(f"optimizer state must be floating point, got {dtype}")
        flat = _core_module().aligned_zeros(
            int(self.param.numel()), dtype, self.param.device, self.alignment
        )
        views = [
            flat.narrow(0, off, n).view(shape)
            for off, n, shape in zip(self.offsets, self.numels, self.shapes, strict=False)
        ]
        return flat, views


def _rebind(
    params: Sequence[torch.Tensor], views: Sequence[torch.Tensor], ptrs: Sequence[int]
) -> None:
    with torch.no_grad():
        for p, view, ptr in zip(params, views, ptrs, strict=False):
            g = p.grad
            if g is not None and g.data_ptr() == ptr and g.shape == view.shape:
                continue
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
            p.grad = view
