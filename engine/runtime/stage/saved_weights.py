"""Saved-tensor hooks that make a backward read other weights than its forward ran on.

Why: without recomputation, autograd keeps what each op saved at the forward until the
backward. For LWP the forward runs on the predicted weights but the backward must use the
live ones; for PipeMare T2 the forward runs on the live weights but the backward must use
w - tau * delta. Keeping the forward's weights alive per micro-batch would cost a weight copy
per micro-batch in flight -- 2(S-1-s)+1 of them at stage s under pb -- which is exactly the
memory these methods exist to save (ALGORITHMS.md, "Weight versions").

So while the forward runs, :meth:`SavedWeights.packing` replaces every saved tensor that is
a view of the forward's weight buffer by a small marker (bucket, offset, size, stride); no
reference to the buffer survives the forward. While the backward runs,
:meth:`SavedWeights.unpacking` turns each marker back into the same view of the backward's
buffer (``as_strided`` on its flat storage): the backward computes with W_B, and the only
weight memory the stage holds is its live buffer plus the one transient.

Stages small enough that a memcpy costs less than a Python call per saved tensor, and whose
backward reads the live weights (LWP, SpecTrain with s_B = 0), skip the hooks: they copy live
into the forward's transient before each backward instead (``Stage._rebase_transient``).

Activations (saved tensors that are not views of the weights) pass through untouched.
Parameters saved directly by a custom autograd Function are views of the buffer too (the
stage runs the module with ``p.data`` pointing at it), so they are remapped the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from engine.runtime.stage.weight_store import WeightStore

__all__ = ["SavedWeights"]


class _Marker:
    """A weight view saved at the forward, to be resolved in the backward's buffer."""

    __slots__ = ("bucket", "offset", "size", "stride")

    def __init__(self, bucket: int, offset: int, size: torch.Size, stride: tuple[int, ...]) -> None:
        self.bucket = bucket
        self.offset = offset
        self.size = size
        self.stride = stride


class SavedWeights:
    """Pack/unpack hooks of one stage (see the module docstring)."""

    def __init__(self, store: WeightStore) -> None:
        self.store = store
        self._ranges: list[tuple[int, int, int, torch.dtype]] = []  # (lo, hi, itemsize, dtype)
        self._targets: list[Tensor] = []

    def _pack_any(self, t: Tensor) -> Any:
        p = t.data_ptr()
        for b, (lo, hi, item, dtype) in enumerate(self._ranges):
            if lo <= p < hi and t.dtype == dtype:
                return _Marker(b, (p - lo) // item, t.size(), t.stride())
        return t

    def _unpack(self, x: Any) -> Tensor:
        if type(x) is _Marker:
            flat = self._targets[x.bucket]
            return flat.as_strided(x.size, x.stride, flat.storage_offset() + x.offset)
        return x

    @contextlib.contextmanager
    def packing(self, buf: int) -> Iterator[None]:
        """Around a forward that runs on buffer ``buf``."""
        self._ranges = [
            (f.data_ptr(), f.data_ptr() + f.numel() * f.element_size(), f.element_size(), f.dtype)
            for f in self.store.flats(buf)
        ]
        pack = self._pack_any
        if len(self._ranges) == 1:  # the common case, without a loop (called per saved tensor)
            lo, hi, item, dtype = self._ranges[0]

            def pack(t: Tensor) -> Any:
                p = t.data_ptr()
                if lo <= p < hi and t.dtype == dtype:
                    return _Marker(0, (p - lo) // item, t.size(), t.stride())
                return t

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    @contextlib.contextmanager
    def unpacking(self, buf: int) -> Iterator[None]:
        """Around a backward that must read buffer ``buf``."""
        self._targets = self.store.flats(buf)
        try:
            yield
        finally:
            self._targets = []
