"""Flat buffers an optimizer steps in one launch: explicit bindings and their state.

Why explicit: a pipeline stage's weights, gradients and weight versions live in the C++
arena's flat buffers, and the runtime that built them hands them to the stage optimizer once
(:meth:`engine.optim.DelayOptimizer.bind_flat`) -- no global registry, no data-pointer
matching, no gradient copies per step. A :class:`FlatBinding` is one arena bucket: its flat
weights and gradients, the optimizer's parameters it holds (in bucket order), and optionally
a flat buffer the step writes the predicted weights into (the runtime's transient slot).

A user who calls ``engine.flatten_(model)`` and then builds an engine optimizer over
``model.parameters()`` gets the same without saying so: each flattened parameter carries a
link to its arena, and :func:`arena_binding` asks that arena whether a group's parameters are
exactly one of its buckets.

Optimizer state for a bound bucket is flat too (``view.make_state``): element i of the
momentum belongs to element i of the weights, so one kernel sweeps weights, gradients and
state together; each parameter's ``state[p][key]`` is a view into it, which keeps
``state_dict()`` in torch's per-parameter layout.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["FlatBinding", "arena_binding"]

_GRAD = operator.attrgetter("grad")


@dataclass(eq=False)
class FlatBinding:
    """One flat bucket bound to an optimizer.

    ``view``: the arena's FlatView (``param``, ``grad``, ``offsets``, ``numels``, ``shapes``,
    ``make_state``); the arena updates ``view.param`` in place when it swaps its live buffer.
    ``params``: the optimizer's tensors this bucket holds, in bucket order. ``predicted``:
    where the step writes w_hat (same layout), or None.
    """

    view: Any
    params: tuple[Tensor, ...]
    predicted: Tensor | None = None
    #: filled by the optimizer: flat state buffers and bookkeeping
    state: dict[str, Tensor] = field(default_factory=dict)
    grad_views: tuple[Tensor, ...] = ()
    initialized: bool = False
    #: set by the step's checks: the binding covers its whole group and every ``.grad`` is its
    #: flat-buffer view (checked once per step, then trusted by the update)
    steady: bool = False
    _covers_key: tuple[int, int] | None = None
    _covers: bool = False

    def check(self) -> None:
        """Raise ValueError when ``params`` do not match the view's layout."""
        v = self.view
        if len(self.params) != len(v.shapes):
            raise ValueError(
                f"a flat binding holds {len(self.params)} tensors but its buffer has "
                f"{len(v.shapes)} slices"
            )
        for i, (p, shape) in enumerate(zip(self.params, v.shapes, strict=True)):
            if tuple(p.shape) != tuple(shape):
                raise ValueError(
                    f"flat binding tensor {i} has shape {tuple(p.shape)}, its slice {tuple(shape)}"
                )
            if p.dtype != v.param.dtype or p.device != v.param.device:
                raise ValueError(
                    f"flat binding tensor {i} is {p.dtype} on {p.device}, the buffer "
                    f"{v.param.dtype} on {v.param.device}"
                )
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a flat binding lists the same tensor twice")

    def grads_in_buffer(self) -> bool:
        """True when every parameter's ``.grad`` is its view of the flat gradient buffer."""
        views = self.grad_views
        if not views:
            return False
        return all(map(operator.is_, map(_GRAD, self.params), views))

    def covers(self, params: list[Tensor]) -> bool:
        """Whether ``params`` are exactly this binding's tensors, in order (cached by the
        list's identity and length: a group's list changes only through add_param_group or
        load_state_dict, which rebuild it)."""
        key = (id(params), len(params))
        if self._covers_key != key:
            self._covers = len(params) == len(self.params) and all(
                map(operator.is_, params, self.params)
            )
            self._covers_key = key
        return self._covers

    def rebind_grads(self) -> None:
        """Copy gradients that are not the buffer's views into it (None counts as zero)."""
        with torch.no_grad():
            for p, g in zip(self.params, self.grad_views, strict=True):
                if p.grad is g:
                    continue
                if p.grad is None:
                    g.zero_()
                else:
                    g.copy_(p.grad)
                p.grad = g


def arena_binding(params: list[Tensor]) -> FlatBinding | None:
    """A binding for ``params`` when they are exactly one bucket of an arena that
    ``engine.flatten_`` built (found through the parameters' own arena link), else None."""
    if not params:
        return None
    link = getattr(params[0], "_engine_arena", None)
    arena = getattr(link, "arena", None)
    if arena is None:
        return None
    view = arena.flat_view_for(params)
    if view is None or view.grad is None:
        return None
    return FlatBinding(view=view, params=tuple(params), grad_views=tuple(view._grad_views))
