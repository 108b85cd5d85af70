"""Per-stage flat weight arena: a stage's parameters and gradients in flat, aligned buffers.

Why: a pipeline stage updates, snapshots and restores *all* of its weights at once, many
times per mini-batch. With one tensor per parameter each of those is a loop of small
kernel launches; with the weights in one flat buffer per (device, dtype, param group,
requires_grad) "bucket" it is one launch (optimizer step), one memcpy (a weight version)
or one access-policy window (L2 persistence). The buffers live in the C++ extension
(``engine._C``, csrc/arena.cpp); this module validates input, names things, and points the
modules' parameters at views of the buffers.

What changes for the user, and what does not:

* ``flatten_(model)`` keeps every ``nn.Parameter`` object (optimizers holding them keep
  working) and only re-points ``p.data`` at a view of the bucket's flat buffer and ``p.grad``
  at a view of the bucket's flat gradient buffer. Forward, backward, ``state_dict`` and
  ``load_state_dict`` behave as before; autograd accumulates into the views in place.
* Every tensor starts at a multiple of ``alignment`` bytes (256 by default); the padding
  between tensors is zero in the weights, the gradients and every slot, and stays zero under
  elementwise optimizer updates, so kernels may sweep whole buffers.
* Weight versions (PipeDream's stashed weights, 2BW's shadow copy, predicted weights) are
  *slots*: whole-arena copies with the same layout. ``snapshot()`` takes one (on CUDA an
  asynchronous copy on a side stream; readers wait on its event automatically),
  ``pin``/``release`` reference-count a slot per micro-batch and free it at zero, and
  ``rotation()`` gives PipeDream-2BW's two-slot double buffer whose swap moves no bytes.
* ``torch.optim``'s default ``zero_grad(set_to_none=True)`` drops the gradient views; the
  next backward then allocates fresh gradients. Call ``arena.zero_grad()`` (or
  ``optimizer.zero_grad(set_to_none=False)``) to keep them in the flat buffer, or
  ``arena.rebind_grads()`` to copy them back in.
* In-place writes through the flat buffers (e.g. a fused optimizer step) do not bump the
  parameters' autograd version counters, as with any ``.data`` update: do not step a stage
  while a graph that saved its weights still has to run backward on them (the pipeline
  stashes weight versions in slots for exactly that).

L2 persistence on a CPU tensor (or in an extension built without CUDA) does not raise: it
returns an :class:`L2Persistence` with ``supported=False`` and the reason, because the same
stage code runs on CPU and GPU machines and a benchmark wants to report "not available"
rather than crash. Everything else that is wrong raises before any tensor moves.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "ArenaError",
    "BucketInfo",
    "DoubleBuffer",
    "FlatView",
    "L2Persistence",
    "SlotError",
    "WeightArena",
    "flat_buffers_for",
    "flatten_",
]

DEFAULT_ALIGNMENT = 256


class ArenaError(ValueError):
    """Input the arena cannot take (raised before any parameter was moved)."""


class SlotError(LookupError):
    """A weight slot that does not exist, was already freed, or is not pinned as claimed."""


def _core_module() -> Any:
    try:
        from engine import _C
    except ImportError as exc:  # pragma: no cover - only on a broken install
        raise ImportError(
            "engine._C (the compiled weight arena) is not importable: "
            f"{exc}. Build it with `pip install --no-build-isolation -e .` "
            "(see docs/building.md)."
        ) from exc
    return _C


# --------------------------------------------------------------------------------------
# public value types


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
    L2 set-aside after the request (cudaLimitPersistingL2CacheSize); ``reason`` says why not.
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


# --------------------------------------------------------------------------------------
# ownership registry: which arena owns which parameter (weak on both sides, so neither a
# dropped arena nor a dropped parameter is kept alive by the registry)

_OWNERS: dict[int, tuple[weakref.ref, weakref.ref, int, int]] = {}
_ARENA_COUNTER = itertools.count()
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


# --------------------------------------------------------------------------------------
# the arena


@dataclass(eq=False)
class _Bucket:
    index: int
    device: torch.device
    dtype: torch.dtype
    group: int
    requires_grad: bool
    params: list[torch.Tensor]
    names: list[str]
    positions: list[int]  # arena-order index of each member
    live_views: list[torch.Tensor]
    grad_views: list[torch.Tensor]
    ptrs: list[int]
    grad_ptrs: list[int]
    flat_view: FlatView
    aliases: dict[tuple[int, ...], FlatView] = field(default_factory=dict)


class DoubleBuffer:
    """Two weight slots for PipeDream-2BW: ``front`` serves forwards/backwards in flight,
    ``back`` receives the next version; ``swap()`` exchanges the slot ids (no bytes move).

    Typical use: ``db.refresh_back()`` after an update copies the live weights into the
    back slot; ``db.swap()`` at a version boundary; ``with arena.use(db.front): ...``.
    """

    def __init__(self, arena: WeightArena, rotation: int) -> None:
        self._arena = arena
        self._id = rotation

    @property
    def front(self) -> int:
        """Slot id of the version in use."""
        return int(self._arena._core.rotation_front(self._id))

    @property
    def back(self) -> int:
        """Slot id of the version being prepared."""
        return int(self._arena._core.rotation_back(self._id))

    def swap(self) -> None:
        """Exchange front and back by index; the slots' buffers stay where they are."""
        self._arena._core.rotation_swap(self._id)

    def refresh_back(self, *, stream: Any = None, overlap: bool = False) -> None:
        """Copy the live weights into the back slot (on CUDA on the side stream, with the
        same ``overlap`` contract as :meth:`WeightArena.snapshot`)."""
        arena = self._arena
        back = self.back
        with arena._on_stream(stream) as handle:
            arena._core.refresh(back, handle)
            if not overlap and arena.device.type == "cuda":
                arena._core.wait(back, handle)

    def front_views(self) -> list[torch.Tensor]:
        return self._arena.slot_views(self.front)

    def back_views(self) -> list[torch.Tensor]:
        return self._arena.slot_views(self.back)

    def close(self) -> None:
        """Free both slots (unless micro-batches still pin them; then the last release does)."""
        self._arena._core.rotation_close(self._id)


class WeightArena:
    """A stage's weights in flat aligned buffers, plus weight-version slots.

    Create one with :func:`flatten_`. Parameters are listed in *arena order*: the order
    they were given in (``module.named_parameters()`` order for a module).
    """

    def __init__(self, *, _core: Any, name: str, alignment: int, device: torch.device) -> None:
        # Built only by flatten_, which validates input and fills the buckets.
        self._core = _core
        self.name = name
        self.alignment = alignment
        self.device = device
        self._buckets: list[_Bucket] = []
        self.params: list[torch.Tensor] = []
        self.names: list[str] = []
        self._place: list[tuple[int, int]] = []  # arena index -> (bucket, position)

    def __repr__(self) -> str:
        return (
            f"WeightArena(name={self.name!r}, params={len(self.params)}, "
            f"buckets={len(self._buckets)}, device={self.device})"
        )

    # ---- layout ------------------------------------------------------------------------

    @property
    def buckets(self) -> list[BucketInfo]:
        """Layout of every flat buffer (device, dtype, group, padded numel, offsets)."""
        out = []
        for b in self._buckets:
            out.append(
                BucketInfo(
                    index=b.index,
                    device=b.device,
                    dtype=b.dtype,
                    group=b.group,
                    requires_grad=b.requires_grad,
                    numel=int(self._core.bucket_numel(b.index)),
                    nbytes=int(self._core.bucket_nbytes(b.index)),
                    offsets=tuple(self._core.bucket_offsets(b.index)),
                    numels=tuple(self._core.bucket_numels(b.index)),
                    names=tuple(b.names),
                )
            )
        return out

    def flat_param(self, bucket: int = 0) -> torch.Tensor:
        """The flat live buffer of a bucket (padding included)."""
        return self._core.bucket_param(self._check_bucket(bucket))

    def flat_grad(self, bucket: int = 0) -> torch.Tensor | None:
        """The flat gradient buffer of a bucket, None for requires_grad=False buckets."""
        return self._core.bucket_grad(self._check_bucket(bucket))

    def flat_view(self, bucket: int = 0) -> FlatView:
        """The :class:`FlatView` of a bucket (what :func:`flat_buffers_for` returns)."""
        return self._buckets[self._check_bucket(bucket)].flat_view

    def _check_bucket(self, bucket: int) -> int:
        if not 0 <= bucket < len(self._buckets):
            raise ArenaError(
                f"arena {self.name!r} has {len(self._buckets)} bucket(s); no bucket {bucket}"
            )
        return bucket

    @contextlib.contextmanager
    def _on_stream(self, stream: Any) -> Iterator[int]:
        """Make ``stream`` current (CUDA) for the call, so that the slot allocations, the
        torch copies and the event waits of one operation all happen on one stream."""
        if self.device.type == "cuda" and stream is not None:
            with torch.cuda.stream(stream):
                yield int(stream.cuda_stream)
        else:
            yield self._stream(None)

    def _stream(self, stream: Any) -> int:
        """cudaStream_t (as int) the caller works on; 0 for CPU arenas."""
        if self.device.type != "cuda":
            return 0
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        return int(stream.cuda_stream)

    # ---- gradients ---------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Zero every flat gradient buffer and point each ``p.grad`` back at its view."""
        with torch.no_grad():
            for b in self._buckets:
                if not b.requires_grad:
                    continue
                self._core.bucket_grad(b.index).zero_()
                for p, view in zip(b.params, b.grad_views, strict=False):
                    if p.grad is not view:
                        p.grad = view

    def rebind_grads(self) -> None:
        """Copy gradients that are not views of the flat buffer into it and re-point them
        (after ``zero_grad(set_to_none=True)`` and a new backward); None counts as zero."""
        for b in self._buckets:
            if b.requires_grad:
                _rebind(b.params, b.grad_views, b.grad_ptrs)

    # ---- weight versions ---------------------------------------------------------------

    def snapshot(
        self, microbatch: int | None = None, *, stream: Any = None, overlap: bool = False
    ) -> int:
        """Copy the live weights into a new slot and return its id.

        With ``microbatch`` the slot starts pinned to it (``release`` then frees it);
        without, it lives until :meth:`free` or until it is pinned and every pin released.

        On CUDA the copy runs on a side stream after the work already queued on ``stream``
        (default: the current stream) and records an event. Readers of the slot
        (:meth:`slot_views`, :meth:`use`, :meth:`restore`) make the current stream wait on
        it. Writers of the live weights must wait too: with ``overlap=False`` (default)
        ``stream`` waits right away (on the GPU; the host never blocks), which is safe with
        any optimizer. ``overlap=True`` lets later work on ``stream`` run alongside the
        copy; then write the live weights only through :func:`flat_buffers_for` (it waits)
        or after :meth:`wait_for_snapshots`. CPU copies are synchronous.
        """
        mb = None if microbatch is None else self._check_microbatch(microbatch)
        with self._on_stream(stream) as handle:
            slot = int(self._core.snapshot(handle, mb))
            if not overlap and self.device.type == "cuda":
                self._core.wait(slot, handle)
        return slot

    def wait_for_snapshots(self, *, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait for every snapshot copy still reading
        the live weights; call before writing them after ``snapshot(overlap=True)``."""
        if self.device.type == "cuda":
            self._core.wait_all(self._stream(stream))

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        """The weights stored in ``slot``, one view per parameter in arena order."""
        self._check_slot(slot)
        self._core.wait(slot, self._stream(None))
        per_bucket = [self._core.slot_views(slot, b.index) for b in self._buckets]
        return [per_bucket[b][i] for b, i in self._place]

    def slot_flat(self, slot: int, bucket: int = 0) -> torch.Tensor:
        """The flat buffer of ``slot`` for one bucket (same layout as the live buffer)."""
        self._check_slot(slot)
        self._core.wait(slot, self._stream(None))
        return self._core.slot_flat(slot, self._check_bucket(bucket))

    @contextlib.contextmanager
    def use(self, slot: int) -> Iterator[list[torch.Tensor]]:
        """Run the modules on the weights of ``slot``: point every ``p.data`` at the slot's
        views, and back at what it was (normally the live buffer) on exit. Gradients still
        accumulate into the live gradient buffer.

        Autograd saves the Parameter objects, not their data at forward time: a backward
        that must see the forward's weights (weight stashing) has to run inside
        ``use(slot)`` too, e.g. ``with arena.use(s): loss.backward()``."""
        views = self.slot_views(slot)
        previous = [p.data for p in self.params]
        try:
            for p, v in zip(self.params, views, strict=False):
                p.data = v
            yield views
        finally:
            for p, d in zip(self.params, previous, strict=False):
                p.data = d

    def restore(self, slot: int, *, stream: Any = None) -> None:
        """Copy the weights of ``slot`` into the live buffers (parameters stay views)."""
        self._check_slot(slot)
        with self._on_stream(stream) as handle:
            self._core.restore(slot, handle)

    def pin(self, slot: int, microbatch: int) -> None:
        """Record that ``microbatch`` uses ``slot`` (one more reference)."""
        self._check_slot(slot)
        self._core.pin(slot, self._check_microbatch(microbatch))

    def release(self, slot: int, microbatch: int) -> bool:
        """Drop ``microbatch``'s reference; frees the slot at zero. Returns True if freed."""
        self._check_slot(slot)
        mb = self._check_microbatch(microbatch)
        pins = dict(self._core.pins(slot))
        if mb not in pins:
            held = ", ".join(map(str, sorted(pins))) or "none"
            raise SlotError(
                f"weight slot {slot} of arena {self.name!r} is not pinned to micro-batch "
                f"{mb} (pinned to: {held}); release only what pin() or "
                "snapshot(microbatch=...) recorded"
            )
        return bool(self._core.release(slot, mb))

    def free(self, slot: int) -> None:
        """Free a slot that no micro-batch pins (e.g. a prediction scratch version)."""
        self._check_slot(slot)
        self._core.free_slot(slot)

    def pins(self, slot: int) -> dict[int, int]:
        """Micro-batch id -> number of pins of ``slot``."""
        self._check_slot(slot)
        return dict(self._core.pins(slot))

    def refcount(self, slot: int) -> int:
        """Pins plus double buffers holding ``slot``."""
        self._check_slot(slot)
        return int(self._core.refcount(slot))

    @property
    def slots(self) -> list[int]:
        """Ids of the slots currently allocated."""
        return [int(s) for s in self._core.slot_ids()]

    def rotation(self, *, stream: Any = None) -> DoubleBuffer:
        """A two-slot double buffer (PipeDream-2BW), both slots initialised to the live
        weights."""
        with self._on_stream(stream) as handle:
            rotation = int(self._core.rotation_create(handle))
            if self.device.type == "cuda":
                self._core.wait(self._core.rotation_front(rotation), handle)
                self._core.wait(self._core.rotation_back(rotation), handle)
        return DoubleBuffer(self, rotation)

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise SlotError(f"weight slot ids are ints returned by snapshot(), got {slot!r}")
        if self._core.has_slot(slot):
            return
        if self._core.was_freed(slot):
            raise SlotError(
                f"weight slot {slot} of arena {self.name!r} was already freed (its last pin "
                "was released or free() was called); snapshot() again for a new version"
            )
        live = ", ".join(map(str, self.slots)) or "none"
        raise SlotError(
            f"arena {self.name!r} has no weight slot {slot} (allocated slots: {live}); "
            "use the id snapshot() returned"
        )

    @staticmethod
    def _check_microbatch(microbatch: int) -> int:
        if isinstance(microbatch, bool) or not isinstance(microbatch, int):
            raise SlotError(f"micro-batch ids are ints, got {microbatch!r}")
        return microbatch

    # ---- accounting and L2 ----------------------------------------------------------

    def bytes(self) -> dict[str, Any]:
        """Bytes held: ``live`` weights, ``grad`` buffers, all ``slots``, ``per_slot``
        (slot id -> bytes) and the ``peak`` of live + grad + slots so far (padding counted)."""
        core = self._core
        return {
            "live": int(core.live_bytes),
            "grad": int(core.grad_bytes),
            "slots": int(core.slot_bytes),
            "per_slot": {int(k): int(v) for k, v in core.per_slot_bytes().items()},
            "peak": int(core.peak_bytes),
        }

    def set_l2_persistence(
        self,
        *,
        bucket: int | None = None,
        hit_ratio: float = 1.0,
        max_bytes: int | None = None,
        stream: Any = None,
    ) -> L2Persistence:
        """Ask the GPU to keep a bucket's live buffer resident in L2 for work on ``stream``
        (default: the current stream; use a non-default ``torch.cuda.Stream``).

        ``bucket`` defaults to the largest bucket (a stream has one access-policy window).
        Reserves min(buffer, ``max_bytes``, device maximum) of L2 device-wide. Returns what
        the device granted; on CPU (or a CPU-only build) ``supported=False`` with the reason.
        """
        if not 0.0 <= float(hit_ratio) <= 1.0:
            raise ArenaError(f"hit_ratio must be in [0, 1], got {hit_ratio}")
        if max_bytes is not None and max_bytes < 0:
            raise ArenaError(f"max_bytes must be >= 0 (or None for no cap), got {max_bytes}")
        if not self._buckets:
            return L2Persistence(False, False, -1, 0, 0, 0, 0, 0.0, f"arena {self.name!r} is empty")
        if bucket is None:
            bucket = max(self._buckets, key=lambda b: int(self._core.bucket_nbytes(b.index))).index
        self._check_bucket(bucket)
        r = self._core.set_l2_persistence(bucket, self._stream(stream), float(hit_ratio), max_bytes or 0)
        return L2Persistence(
            supported=bool(r["supported"]),
            ok=bool(r["ok"]),
            bucket=int(r["bucket"]),
            granted_bytes=int(r["granted_bytes"]),
            window_bytes=int(r["window_bytes"]),
            max_persisting_bytes=int(r["max_persisting_bytes"]),
            max_window_bytes=int(r["max_window_bytes"]),
            hit_ratio=float(r["hit_ratio"]),
            reason=str(r["reason"]),
        )

    def clear_l2_persistence(self, *, bucket: int = 0, stream: Any = None) -> None:
        """Remove the window from ``stream`` and give the L2 set-aside back to the device."""
        if self.device.type != "cuda":
            raise ArenaError(
                f"arena {self.name!r} is on {self.device}: there is no L2 window to clear"
            )
        self._core.clear_l2_persistence(self._check_bucket(bucket), self._stream(stream))


# --------------------------------------------------------------------------------------
# flatten_: validation first, then one move


ParamsLike = nn.Module | torch.Tensor | Iterable[Any]


def _collect(module_or_params: ParamsLike) -> list[tuple[str, torch.Tensor, int]]:
    """(qualified name, tensor, param group) for every parameter, in arena order."""
    if isinstance(module_or_params, nn.Module):
        return [(n, p, 0) for n, p in module_or_params.named_parameters()]
    if isinstance(module_or_params, torch.Tensor):
        return [("params[0]", module_or_params, 0)]
    if isinstance(module_or_params, (str, bytes)) or not isinstance(module_or_params, Iterable):
        raise TypeError(
            "flatten_ takes an nn.Module, an iterable of parameters, of (name, parameter) "
            f"pairs, or of param-group dicts; got {type(module_or_params).__name__}"
        )
    items = list(module_or_params)
    out: list[tuple[str, torch.Tensor, int]] = []
    if items and all(isinstance(x, dict) for x in items):
        for g, group in enumerate(items):
            if "params" not in group:
                raise TypeError(f"param group {g} has no 'params' entry")
            ps = group["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            for i, p in enumerate(ps):
                if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
                    out.append((p[0], p[1], g))
                else:
                    out.append((f"param_groups[{g}].params[{i}]", p, g))
        return out
    for i, x in enumerate(items):
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
            out.append((x[0], x[1], 0))
        else:
            out.append((f"params[{i}]", x, 0))
    return out


def _check_alignment(alignment: int) -> None:
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment <= 0
        or alignment & (alignment - 1)
    ):
        raise ArenaError(
            f"alignment must be a positive power of two in bytes (e.g. 256), got {alignment!r}"
        )


def _validate(entries: list[tuple[str, torch.Tensor, int]], arena_name: str) -> torch.device | None:
    seen: dict[int, str] = {}
    first: tuple[str, torch.device] | None = None
    for name, p, _group in entries:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {name!r} is a {type(p).__name__}, not a torch.Tensor")
        if id(p) in seen:
            raise ArenaError(
                f"parameter {name!r} is the same tensor as {seen[id(p)]!r}; list each "
                "parameter once (tied weights appear once in module.parameters())"
            )
        seen[id(p)] = name
        if not p.is_leaf:
            raise ArenaError(
                f"parameter {name!r} is not a leaf tensor (it was computed from other "
                "tensors); pass the nn.Parameter itself"
            )
        if p.layout != torch.strided:
            raise ArenaError(
                f"parameter {name!r} has layout {p.layout}; the arena holds dense tensors only"
            )
        if not p.dtype.is_floating_point:
            kind = "complex" if p.dtype.is_complex else "integer/bool"
            raise ArenaError(
                f"parameter {name!r} has {kind} dtype {p.dtype}; the arena holds real "
                "floating-point weights only (optimizers update them in place). Keep such "
                "tensors as buffers (module.register_buffer) or convert them (p.float())"
            )
        if first is None:
            first = (name, p.device)
        elif p.device != first[1]:
            raise ArenaError(
                f"parameter {name!r} is on {p.device} but {first[0]!r} is on {first[1]}; one "
                f"stage (arena {arena_name!r}) lives on one device: move the module there "
                "first (module.to(device)) or split it into one stage per device"
            )
        owner = _owner_of(p)
        if owner is not None:
            raise ArenaError(
                f"parameter {name!r} already belongs to arena {owner.name!r}, so it cannot "
                f"also go into arena {arena_name!r}: a parameter shared by two stages would "
                "be updated by both. Give each stage its own copy (copy.deepcopy) or put "
                "its users in the same stage"
            )
    return None if first is None else first[1]


def flatten_(
    module_or_params: ParamsLike,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    name: str | None = None,
) -> WeightArena:
    """Move a stage's parameters into a new :class:`WeightArena`, in place.

    ``module_or_params``: an ``nn.Module`` (its ``named_parameters()``; errors then name
    parameters by their qualified names), an iterable of tensors or of (name, tensor)
    pairs, or a list of param-group dicts (``{"params": [...]}``; each group gets its own
    buckets, as optimizers treat groups separately). Parameters are grouped into buckets by
    (device, dtype, param group, requires_grad); each tensor's slice starts at a multiple of
    ``alignment`` bytes (a power of two). Every ``nn.Parameter`` object is kept; its
    ``.data`` becomes a view of the flat buffer and, for requires_grad parameters, its
    ``.grad`` a view of the flat gradient buffer (an existing gradient is copied in).

    Everything is validated before any tensor moves: mixed devices, non-floating dtypes,
    non-leaf or sparse tensors, duplicates, parameters another arena owns, and a bad
    ``alignment`` raise :class:`ArenaError` (or TypeError) and leave the input untouched.
    """
    _check_alignment(alignment)
    arena_name = name if name is not None else f"arena{next(_ARENA_COUNTER)}"
    entries = _collect(module_or_params)
    device = _validate(entries, arena_name)

    core_mod = _core_module()
    core = core_mod.Arena(alignment)
    arena = WeightArena(
        _core=core, name=arena_name, alignment=alignment, device=device or torch.device("cpu")
    )

    # Group into buckets in order of first appearance; nothing has moved yet, and the
    # C++ side only copies, so a failure here still leaves the parameters as they were.
    keys: dict[tuple[str, torch.dtype, int, bool], list[int]] = {}
    for idx, (_n, p, group) in enumerate(entries):
        keys.setdefault((str(p.device), p.dtype, group, bool(p.requires_grad)), []).append(idx)
    built = []
    for b, ((_dev, dtype, group, rg), members) in enumerate(keys.items()):
        tensors = [entries[i][1].detach() for i in members]
        index = int(core.add_bucket(tensors, group, rg))
        assert index == b
        live = list(core.param_views(b))
        grads = list(core.grad_views(b)) if rg else []
        built.append((b, dtype, group, rg, members, live, grads))

    # Commit: re-point every parameter (cannot fail after the checks above).
    place: list[tuple[int, int]] = [(0, 0)] * len(entries)
    with torch.no_grad():
        for b, dtype, group, rg, members, live, grads in built:
            params = [entries[i][1] for i in members]
            for pos, (i, p) in enumerate(zip(members, params, strict=False)):
                old_grad = p.grad
                p.data = live[pos]
                if rg:
                    if old_grad is not None:
                        grads[pos].copy_(old_grad)
                    p.grad = grads[pos]
                place[i] = (b, pos)
            ptrs = [v.data_ptr() for v in live] if live[0].device.type != "meta" else [0] * len(live)
            grad_ptrs = (
                [v.data_ptr() for v in grads] if rg and grads[0].device.type != "meta" else [0] * len(grads)
            )
            flat_grad = core.bucket_grad(b)
            view = FlatView(
                param=core.bucket_param(b),
                grad=flat_grad,
                offsets=[int(o) for o in core.bucket_offsets(b)],
                numels=[int(n) for n in core.bucket_numels(b)],
                params=tuple(params),
                shapes=tuple(p.shape for p in params),
                alignment=alignment,
                _grad_views=tuple(grads),
                _grad_ptrs=tuple(grad_ptrs),
            )
            arena._buckets.append(
                _Bucket(
                    index=b,
                    device=params[0].device,
                    dtype=dtype,
                    group=group,
                    requires_grad=rg,
                    params=params,
                    names=[entries[i][0] for i in members],
                    positions=list(members),
                    live_views=live,
                    grad_views=grads,
                    ptrs=ptrs,
                    grad_ptrs=grad_ptrs,
                    flat_view=view,
                )
            )
    arena.params = [p for _n, p, _g in entries]
    arena.names = [n for n, _p, _g in entries]
    arena._place = place

    arena_ref = weakref.ref(arena)
    for b in arena._buckets:
        for pos, p in enumerate(b.params):
            key = id(p)
            ref = weakref.ref(p, lambda r, k=key: _forget(k, r))
            _OWNERS[key] = (ref, arena_ref, b.index, pos)
            p._engine_arena = _ArenaLink(arena)  # keeps the arena alive with its params
        if b.ptrs and b.ptrs[0]:
            _BY_PTR.setdefault(b.ptrs[0], []).append((arena_ref, b.index))
    weakref.finalize(arena, _forget_ptrs, [(b.ptrs[0], b.index) for b in arena._buckets if b.ptrs])
    return arena
