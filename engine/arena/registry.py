"""Which arena owns which parameter, and :func:`flat_buffers_for`, the optimizers' way in.

Why a registry at all: ``torch.optim``-style optimizers receive only parameter lists, so a
fused optimizer has to find the flat buffers behind them from the tensors alone. The
registry answers that in O(len(params)) identity and pointer checks per step. It is module
state (the dictionaries below) and weak on both sides: a dropped arena or a dropped
parameter is never kept alive by it. REVIEW-runtime.md (section 1.2c) suggests replacing
it by an explicit binding (the stage hands its ``FlatView``s to the optimizer); until then
this module is the one place that knows about it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.arena.views import FlatView

if TYPE_CHECKING:
    from engine.arena.weight_arena import WeightArena

# --------------------------------------------------------------------------------------
# ownership registry: which arena owns which parameter (weak on both sides, so neither a
# dropped arena nor a dropped parameter is kept alive by the registry)

_OWNERS: dict[int, tuple[weakref.ref, weakref.ref, int, int]] = {}
# data pointer of a bucket's first live view -> (arena, bucket index): finds the bucket of
# *aliases* (other tensors viewing the same storage, e.g. a pipeline's shadow Parameters)
_BY_PTR: dict[int, list[tuple[weakref.ref, int]]] = {}


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


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _OWNERS.get(key)
    if entry is not None and entry[0] is ref:
        del _OWNERS[key]


def _owner_of(p: torch.Tensor) -> WeightArena | None:
    entry = _OWNERS.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    arena = entry[1]()
    return arena


def flat_buffers_for(params: Sequence[torch.Tensor]) -> FlatView | None:
    """Return the flat buffers when ``params`` are exactly one bucket's parameters, or
    aliases of them (other tensors viewing exactly the bucket's live storage in bucket order,
    such as the shadow Parameters a pipeline stage hands its optimizer; see ``_alias_view``).

    "Exactly" means the same tensors in the same order as the bucket (its
    ``BucketInfo.names`` order) and each one still a view into the bucket's live buffer
    (``p.data_ptr()`` where the arena put it). Anything else -- a subset, another order,
    parameters of two buckets, a parameter whose ``.data`` the user replaced, or weights
    temporarily pointed at a slot by ``WeightArena.use`` -- gives None, and the caller
    falls back to its per-tensor path. Costs O(len(params)) identity and pointer checks,
    so optimizers may call it every step. On CUDA it also makes the current stream wait
    for snapshot copies still reading the live buffer, since the caller is about to
    write it.
    """
    if not isinstance(params, (list, tuple)):
        params = list(params)
    if not params:
        return None
    entry = _OWNERS.get(id(params[0]))
    if entry is None or entry[0]() is not params[0]:
        return _alias_view(params)
    arena = entry[1]()
    if arena is None:
        return None
    bucket = arena._buckets[entry[2]]
    members = bucket.params
    if len(params) != len(members):
        return None
    for p, q, ptr in zip(params, members, bucket.ptrs, strict=False):
        if p is not q or p.data_ptr() != ptr:
            return None
    if bucket.device.type == "cuda":
        arena._core.wait_all(arena._stream(None))
    return bucket.flat_view


def _alias_view(params: Sequence[torch.Tensor]) -> FlatView | None:
    """The FlatView for tensors that are not the bucket's Parameters but view exactly its live
    storage, member by member (same data pointer, shape, dtype and device, same order).

    Why: a pipeline steps *shadow* Parameters that share the live buffer, so that the in-place
    update does not bump the module Parameters' autograd version counters while in-flight
    graphs still hold them (engine/runtime/weights.py). Matching by identity alone would send
    such a stage down the per-tensor path. The returned view has the bucket's flat buffers and
    ``params`` = the given tensors (their ``.grad`` is what ``rebind_grads`` points at the flat
    gradient); it is cached on the bucket per tuple of tensors.
    """
    candidates = _BY_PTR.get(params[0].data_ptr()) if params[0].numel() else None
    if not candidates:
        return None
    for arena_ref, index in candidates:
        arena = arena_ref()
        if arena is None:
            continue
        bucket = arena._buckets[index]
        members = bucket.params
        if len(params) != len(members):
            continue
        if not all(
            p.data_ptr() == ptr and p.shape == q.shape and p.dtype == q.dtype and p.device == q.device
            for p, q, ptr in zip(params, members, bucket.ptrs, strict=False)
        ):
            continue
        key = tuple(id(p) for p in params)
        view = bucket.aliases.get(key)
        if view is None or any(a is not b for a, b in zip(view.params, params, strict=False)):
            base = bucket.flat_view
            view = FlatView(
                param=base.param,
                grad=base.grad,
                offsets=base.offsets,
                numels=base.numels,
                params=tuple(params),
                shapes=base.shapes,
                alignment=base.alignment,
                _grad_views=base._grad_views,
                _grad_ptrs=base._grad_ptrs,
            )
            bucket.aliases[key] = view
        if bucket.device.type == "cuda":
            arena._core.wait_all(arena._stream(None))
        return view
    return None


def _forget_ptrs(entries: list[tuple[int, int]]) -> None:
    """Drop a collected arena's buckets from the pointer registry."""
    for ptr, _index in entries:
        alive = [(r, i) for r, i in _BY_PTR.get(ptr, []) if r() is not None]
        if alive:
            _BY_PTR[ptr] = alive
        else:
            _BY_PTR.pop(ptr, None)


def register(arena: WeightArena) -> None:
    """Record a freshly built arena's parameters (identity) and buckets (live pointer).

    Called once by ``flatten_`` after every parameter was re-pointed.
    """
    arena_ref = weakref.ref(arena)
    for b in arena._buckets:
        for pos, p in enumerate(b.params):
            key = id(p)
            ref = weakref.ref(p, lambda r, k=key: _forget(k, r))
            _OWNERS[key] = (ref, arena_ref, b.index, pos)
            p._engine_arena = _ArenaLink(arena)  # keeps the arena alive with its params
        if b.ptrs and b.ptrs[0]:
            _BY_PTR.setdefault(b.ptrs[0], []).append((arena_ref, b.index))
    # One list, shared by the arena (repoint updates it in place) and its finalizer, so the
    # finalizer drops the entries under the pointers the buckets have at collection time.
    arena._ptr_keys = [(b.ptrs[0], b.index) for b in arena._buckets if b.ptrs]
    weakref.finalize(arena, _forget_ptrs, arena._ptr_keys)


def repoint(arena: WeightArena, index: int, old: int, new: int) -> None:
    """Move bucket ``index`` of ``arena`` from live pointer ``old`` to ``new`` (after
    ``WeightArena.swap_live``), so that aliases of the new live buffer are found and
    tensors still viewing the old one (now a slot) are not."""
    if old:
        rest = [(r, i) for r, i in _BY_PTR.get(old, []) if not (r() is arena and i == index)]
        if rest:
            _BY_PTR[old] = rest
        else:
            _BY_PTR.pop(old, None)
    if new:
        _BY_PTR.setdefault(new, []).append((weakref.ref(arena), index))
    keys = arena._ptr_keys
    for k, (_ptr, i) in enumerate(keys):
        if i == index:
            keys[k] = (new, index)
