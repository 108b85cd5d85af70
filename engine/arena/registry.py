"""Which arena owns which parameter, and :func:`flat_buffers_for`, the optimizers' way in.

Why a link on the parameter and not a global table: ``engine.flatten_(model)`` followed by
``engine.optim.SGD(model.parameters())`` must find the flat buffers from the parameters
alone. Every flattened parameter carries an ``_engine_arena`` link to its arena, and the arena
knows, by identity, which bucket and position each of its parameters has. No module-level
registry, no data-pointer matching: the pipeline runtime does not even need this (it hands
its optimizers their flat buffers explicitly, see ``engine.optim.flat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.arena.views import FlatView

if TYPE_CHECKING:
    from engine.arena.weight_arena import WeightArena


class _ArenaLink:
    """Strong reference from a parameter to its arena (stored in ``p.__dict__``).

    Why: ``flatten_(model)`` is often called for its effect only; without this link the
    WeightArena would be collected at once and :func:`flat_buffers_for` would stop finding
    the buckets. The reference cycle parameter -> arena -> parameter is ordinary garbage:
    the cycle collector frees both once the module is gone. The link does not travel:
    ``copy.deepcopy`` of a Parameter ignores its ``__dict__``, and pickling stores an empty
    link (a copy is not a view of this arena, so it must not claim to be in it).
    """

    __slots__ = ("arena",)

    def __init__(self, arena: WeightArena | None = None) -> None:
        self.arena = arena

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (_ArenaLink, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> _ArenaLink:
        return _ArenaLink()


def _owner_of(p: torch.Tensor) -> WeightArena | None:
    """The arena ``p`` belongs to (through its link, confirmed by the arena), or None."""
    link = p.__dict__.get("_engine_arena") if hasattr(p, "__dict__") else None
    arena = getattr(link, "arena", None)
    if arena is None or arena._where.get(id(p)) is None:
        return None
    b, pos = arena._where[id(p)]
    return arena if arena._buckets[b].params[pos] is p else None


def flat_buffers_for(params: Sequence[torch.Tensor]) -> FlatView | None:
    """Return the flat buffers when ``params`` are exactly one bucket's parameters.

    "Exactly" means the same tensors in the same order as the bucket (its
    ``BucketInfo.names`` order) and each one still a view into the bucket's live buffer
    (``p.data_ptr()`` where the arena put it). Anything else -- a subset, another order,
    parameters of two buckets, a parameter whose ``.data`` the user replaced, or weights
    temporarily pointed at a slot by ``WeightArena.use`` -- gives None, and the caller
    falls back to its per-tensor path. Costs O(len(params)) identity and pointer checks.
    On CUDA it also makes the current stream wait for snapshot copies still reading the
    live buffer, since the caller is about to write it.
    """
    if not isinstance(params, (list, tuple)):
        params = list(params)
    if not params:
        return None
    arena = _owner_of(params[0])
    if arena is None:
        return None
    return arena.flat_view_for(params)


def register(arena: WeightArena) -> None:
    """Link a freshly built arena's parameters to it. Called once by ``flatten_``."""
    for b in arena._buckets:
        for pos, p in enumerate(b.params):
            arena._where[id(p)] = (b.index, pos)
            p._engine_arena = _ArenaLink(arena)  # keeps the arena alive with its params
