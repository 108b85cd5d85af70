"""Static staging buffers: the user's batch copied to fixed addresses before a captured step.

Why: a CUDA graph replays kernels with their pointers frozen. The one tensor from outside a
synchronous step that moves between steps is the user's batch (the capture audit's
"input batch (needs a static staging buffer)"). So before the window every tensor leaf of
every micro-batch slot's inputs and targets -- trees, masks and integer ids included -- is
copied (one ``copy_`` per leaf and slot, on the caller's stream, outside the window) into a
buffer made once for that slot and leaf; the window reads only those buffers, so it reads
the same addresses every step and a replay sees this step's batch.

A batch's *staging key* is everything the buffers and the window depend on: each slot's
tree structure, each tensor leaf's shape, dtype, device and layout, and each non-tensor
leaf's value (a constant is baked into the captured calls). A new key gets new buffers (the
old ones stay with the graph captured on them, until the capture cache drops it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Staging", "staging_key"]


def _leaf_key(leaf: Any) -> Hashable:
    if isinstance(leaf, Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.layout)
    try:
        hash(leaf)
    except TypeError:
        return ("object", type(leaf).__qualname__, id(leaf))
    return ("constant", type(leaf).__qualname__, leaf)


def staging_key(xs: Sequence[Any], targets: Sequence[Any]) -> tuple[Hashable, ...] | str:
    """The staging key of a step's micro-batches, or why they cannot be staged (a str)."""
    parts: list[Hashable] = []
    for kind, slots in (("inputs", xs), ("targets", targets)):
        for m, tree in enumerate(slots):
            leaves, spec = tree_flatten(tree)
            for k, leaf in enumerate(leaves):
                if isinstance(leaf, Tensor) and leaf.requires_grad:
                    return (f"micro-batch {m}'s {kind} leaf {k} requires grad (a staged copy "
                            "would cut it from its graph)")
                if isinstance(leaf, Tensor) and not leaf.layout == torch.strided:
                    return f"micro-batch {m}'s {kind} leaf {k} is {leaf.layout} (not strided)"
            parts.append((kind, m, str(spec), tuple(_leaf_key(x) for x in leaves)))
    return tuple(parts)


class Staging:
    """The static buffers of one staging key: ``stage(xs, targets)`` copies the batch into
    them and returns the micro-batch trees built on the buffers (the same objects every
    step, so the window reads the same tensors)."""

    def __init__(self, xs: Sequence[Any], targets: Sequence[Any]) -> None:
        self.xs, self._x_bufs = self._make(xs)
        self.targets, self._t_bufs = self._make(targets)
        #: copies made so far (one per tensor leaf and slot per step)
        self.copies = 0

    @staticmethod
    def _make(slots: Sequence[Any]) -> tuple[list[Any], list[list[Tensor | None]]]:
        trees: list[Any] = []
        bufs: list[list[Tensor | None]] = []
        for tree in slots:
            leaves, spec = tree_flatten(tree)
            # contiguous buffers whatever the user's strides: copy_ converts
            made = [torch.empty(x.shape, dtype=x.dtype, device=x.device) if isinstance(x, Tensor)
                    else None for x in leaves]
            bufs.append(made)
            trees.append(tree_unflatten([b if b is not None else x for b, x in zip(made, leaves, strict=True)],
                                        spec))
        return trees, bufs

    def stage(self, xs: Sequence[Any], targets: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """Copy every tensor leaf into its buffer (the caller checked the staging key)."""
        for slots, bufs in ((xs, self._x_bufs), (targets, self._t_bufs)):
            for tree, made in zip(slots, bufs, strict=True):
                for buf, leaf in zip(made, tree_flatten(tree)[0], strict=True):
                    if buf is not None:
                        buf.copy_(leaf)
                        self.copies += 1
        return self.xs, self.targets

    def buffers(self) -> list[Tensor]:
        """Every staging buffer (tests check their addresses)."""
        return [b for made in (*self._x_bufs, *self._t_bufs) for b in made if b is not None]
