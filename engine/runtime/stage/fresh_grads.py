"""Weight gradients accumulated into the flat buffers with one multi-tensor add per backward.

Why: a stage's parameters keep their ``.grad`` as views of the arena's flat gradient buffers
for the stage's whole life, so autograd's AccumulateGrad adds every new gradient in place:
one ``add_`` launch per parameter and micro-batch, where a plain loop with
``zero_grad(set_to_none=True)`` launches none (a large share of a pb batch-1 step's launches:
tests/runtime/capture/test_launch_counts.py counts them). Here, around a backward, the parameters'
``.grad`` are set to None, so AccumulateGrad hands each new gradient over without a launch
(post-accumulate hooks still fire), and afterwards every ``.grad`` points at its view again
and the new gradients are added with one ``torch._foreach_add_``: the same elementwise
``view + grad`` in the same order as AccumulateGrad's ``+=``, so the sums are bit for bit
what they were.

**No zero_ after an update** (pb updates every stage at every micro-batch, and zeroing the flat buffer was one launch per stage update that the plain loop, which sets
``.grad`` to None, does not make). ``WeightStore.zero_grads`` (after an update, or a
discarded group) marks the group :attr:`FreshGrads.stale` instead; the group's first
backward then *writes* the views with one ``_foreach_copy_`` (and zeroes, with one
``_foreach_zero_``, the views of parameters that got no gradient in it), later ones add as
above. So every group's first backward is a copy whatever came before, and a captured
window replays the same calls. A copy of ``g`` is ``0 + g`` bit for bit but for the sign of
a zero (``0 + -0`` is ``+0``; the copy keeps ``-0``, as torch's ``.grad`` of a fresh
backward does; ``torch.equal`` holds). Whatever reads the buffers before a backward wrote
them (an update whose group got no gradient, the tie sum, a saved in-flight state) asks
the store first (``settle_grads``, ``grad_state``): a stale buffer counts as zero.

The price is memory: a stage's fresh gradients are alive together until the add (before,
each was freed after its own add). So only stages with at most :data:`MAX_BYTES` of
gradients take this path -- the small, launch-bound stages it is for; big stages are
compute-bound and keep AccumulateGrad's in-place adds.

Only on a GPU, where each ``add_`` is a kernel launch: on a CPU nothing is launched, and
there the fresh allocations cost more than the adds they save (docs/design-notes.md). :data:`ON_CPU` turns it on
for CPU stages too, so CPU tests run (and count the calls of) the GPU path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["MAX_BYTES", "ON_CPU", "FreshGrads", "backward", "fresh_grads"]

#: stages with at most this many gradient bytes accumulate with one multi-tensor add
MAX_BYTES = 16 << 20
#: take this path for CPU stages too (tests: the GPU path's calls and results, on a CPU)
ON_CPU = False


class FreshGrads:
    """One stage's parameters that hold gradient views, and whether they take this path."""

    __slots__ = ("params", "views", "enabled", "peers", "stale")

    def __init__(self, params: Iterable[Any], views: Iterable[Tensor | None]) -> None:
        pairs = [(p, v) for p, v in zip(params, views, strict=True) if v is not None]
        self.params = [p for p, _ in pairs]
        self.views = [v for _, v in pairs]
        nbytes = sum(v.numel() * v.element_size() for v in self.views)
        self.enabled = (
            bool(pairs)
            and nbytes <= MAX_BYTES
            and (ON_CPU or all(v.device.type != "cpu" for v in self.views))
            and not any(v.is_sparse for v in self.views)
        )
        #: the other stages' groups a chained backward of this stage runs through
        #: (a synchronous step in one process; set by the executor)
        self.peers: tuple[FreshGrads, ...] = ()
        #: the views hold an applied update's gradients (not zeroed): the next backward
        #: writes them instead of adding (set by the store, only when ``enabled``)
        self.stale = False

    def detach(self) -> None:
        for p in self.params:
            p.grad = None

    def restore(self) -> tuple[list[Tensor], list[Tensor]]:
        """Point every ``.grad`` back at its view; returns (views, the new gradients)."""
        views: list[Tensor] = []
        grads: list[Tensor] = []
        for p, v in zip(self.params, self.views):  # noqa: B905 - same length
            g = p.grad
            p.grad = v
            if g is not None and g is not v:
                views.append(v)
                grads.append(g)
        return views, grads


def _per_tensor(views: list[Tensor], grads: list[Tensor]) -> bool:
    """Whether a gradient is sparse or of another dtype than its view: then one op per
    tensor (what AccumulateGrad does), not one foreach op for all."""
    return any(g.is_sparse or g.dtype != v.dtype for g, v in zip(grads, views))  # noqa: B905


def _add(views: list[Tensor], grads: list[Tensor]) -> None:
    if not grads:
        return
    with torch.no_grad():
        if _per_tensor(views, grads):
            for v, g in zip(views, grads):  # noqa: B905 - rare: what AccumulateGrad would do
                v.add_(g)
        else:
            torch._foreach_add_(views, grads)


def _write(group: FreshGrads, views: list[Tensor], grads: list[Tensor]) -> None:
    """The first backward of an update group into a stale buffer: the views that got a
    gradient take it (a copy), the others are zeroed; as a zeroed buffer plus :func:`_add`."""
    with torch.no_grad():
        if len(views) < len(group.views):
            got = {id(v) for v in views}
            torch._foreach_zero_([v for v in group.views if id(v) not in got])
        if not grads:
            return
        if _per_tensor(views, grads):
            for v, g in zip(views, grads):  # noqa: B905 - rare: zero and add, as before
                v.zero_()
                v.add_(g)
        else:
            torch._foreach_copy_(views, grads)


@contextlib.contextmanager
def fresh_grads(groups: Iterable[FreshGrads]) -> Iterator[None]:
    """Around one autograd call: the enabled ``groups`` receive fresh gradients, added to
    their views on exit (also when the backward raised: what arrived is accumulated, as
    AccumulateGrad would have, and every ``.grad`` is a view again)."""
    active = [g for group in groups for g in (group, *group.peers) if g.enabled]
    for g in active:
        g.detach()
    try:
        yield
    finally:
        got = [g.restore() for g in active]  # every .grad a view again before any add
        for g, (views, grads) in zip(active, got):  # noqa: B905 - same length
            if g.stale:
                g.stale = False
                _write(g, views, grads)
            else:
                _add(views, grads)


def backward(roots: list[Tensor], grads: list[Any], groups: Iterable[FreshGrads], **kwargs: Any) -> None:
    """``torch.autograd.backward(roots, grads, **kwargs)`` with ``groups`` (and their peers)
    receiving fresh gradients. When none takes this path (CPU stages) the call is made
    directly: the context manager's generator costs ~20 us of host time per backward."""
    groups = groups if isinstance(groups, (list, tuple)) else list(groups)
    if not any(g.enabled for group in groups for g in (group, *group.peers)):
        torch.autograd.backward(roots, grads, **kwargs)
        return
    with fresh_grads(groups):
        torch.autograd.backward(roots, grads, **kwargs)
