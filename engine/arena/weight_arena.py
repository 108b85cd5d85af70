"""The :class:`WeightArena`: a stage's flat buffers, weight-version slots, pins, the slot
pool, the O(1) live/slot swap, byte accounting and L2 windows.

Why the Python object keeps its own per-bucket state (``_Bucket``) next to the C++ core:
the core knows buffers and offsets, but only Python knows the ``nn.Parameter`` objects
whose ``.data`` must follow the live buffer, the names errors are phrased in, and the
cached :class:`FlatView` that optimizers receive every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.arena import l2
from engine.arena.core import ArenaError, SlotError
from engine.arena.double_buffer import DoubleBuffer
from engine.arena.views import BucketInfo, FlatView, L2Persistence, _rebind


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
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position)
        self._using = 0  # depth of use() contexts: swap_live is refused inside them
        # engine.testing.arena_twin.ArenaTwin of a traced CPU arena: it stands in for the
        # CUDA streams, so the CUDA paths below run (and are checked) on a CPU
        self._twin: Any = None

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
        """The :class:`FlatView` of a bucket (what :func:`flat_buffers_for` returns). The
        object stays the same for the arena's life; :meth:`swap_live` updates its
        ``param`` to the new live buffer."""
        return self._buckets[self._check_bucket(bucket)].flat_view

    def flat_view_for(self, params: Sequence[torch.Tensor]) -> FlatView | None:
        """The :class:`FlatView` of the bucket whose parameters are exactly ``params`` (the
        same objects, in bucket order, each still viewing the live buffer), else None. On
        CUDA the current stream first waits for snapshot copies still reading live (the
        caller is about to write it)."""
        if not params:
            return None
        where = self._where.get(id(params[0]))
        if where is None:
            return None
        bucket = self._buckets[where[0]]
        members = bucket.params
        if len(params) != len(members):
            return None
        for p, q, ptr in zip(params, members, bucket.ptrs, strict=True):
            if p is not q or p.data_ptr() != ptr:
                return None
        if self._evented:
            self._core.wait_all(self._stream(None))
        return bucket.flat_view

    def live_views(self) -> list[torch.Tensor]:
        """The live weights, one view per parameter in arena order (what ``p.data`` is,
        outside :meth:`use`)."""
        return [self._buckets[b].live_views[i] for b, i in self._place]

    def _check_bucket(self, bucket: int) -> int:
        if not 0 <= bucket < len(self._buckets):
            raise ArenaError(
                f"arena {self.name!r} has {len(self._buckets)} bucket(s); no bucket {bucket}"
            )
        return bucket

    @property
    def _evented(self) -> bool:
        """Whether snapshot copies are asynchronous and carry events that readers and
        writers wait on: CUDA arenas, and the CPU twin of one (a traced arena)."""
        return self.device.type == "cuda" or self._twin is not None

    @contextlib.contextmanager
    def _on_stream(self, stream: Any) -> Iterator[int]:
        """Make ``stream`` current (CUDA) for the call, so that the slot allocations, the
        torch copies and the event waits of one operation all happen on one stream."""
        if self._twin is not None:
            with self._twin.use(stream):
                yield self._twin.handle(None)
        elif self.device.type == "cuda" and stream is not None:
            with torch.cuda.stream(stream):
                yield int(stream.cuda_stream)
        else:
            yield self._stream(None)

    def _stream(self, stream: Any) -> int:
        """cudaStream_t (as int) the caller works on; 0 for CPU arenas."""
        if self._twin is not None:
            return int(self._twin.handle(stream))
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

        On CUDA the copy runs on the arena's own snapshot stream (created on the first CUDA
        snapshot, one per arena, so other stages' copies never queue in front of it) after
        the work already queued on ``stream`` (default: the current stream) and records an
        event. Readers of the slot
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
            if not overlap and self._evented:
                self._core.wait(slot, handle)
        return slot

    def new_slot(self, microbatch: int | None = None, *, stream: Any = None) -> int:
        """A new slot whose contents are unspecified, for callers that overwrite it whole
        (an optimizer writing predicted weights into it, a copy the caller makes); no copy,
        no fill. ``microbatch`` pins it as in :meth:`snapshot`.

        Its buffers come from the pool when a freed slot left some (they then hold that
        slot's last values), else they are allocated and zeroed once. Either way the
        padding between tensors is zero, as in every buffer the arena hands out: the arena
        never writes padding, so keep it that way (write through :meth:`slot_views`, or
        sweep the flat buffer with elementwise kernels whose inputs have zero padding).

        On CUDA, a pooled buffer's previous users are ordered before ``stream`` (default:
        the current stream; see :meth:`release`); write the slot on that stream.
        """
        mb = None if microbatch is None else self._check_microbatch(microbatch)
        with self._on_stream(stream) as handle:
            return int(self._core.new_slot(handle, mb))

    def swap_live(self, slot: int, *, stream: Any = None) -> None:
        """Exchange the live buffers with ``slot``'s buffers in O(1): no bytes move.

        Afterwards every parameter's ``.data`` is a view of the new live memory (the
        ``nn.Parameter`` objects stay the same; a parameter whose ``.data`` the user had
        pointed elsewhere is left alone), :meth:`flat_param`, :meth:`flat_view` (the same
        object, its ``param`` updated) and :func:`flat_buffers_for` describe the new live
        memory, gradients are untouched, and ``slot`` names the old live memory, with its
        pins. Byte accounting does not change. Refused inside :meth:`use`.

        Tensors created earlier as views of the old live memory keep pointing at it, so an
        autograd graph whose saved tensors are *views* of the weights (e.g. ``nn.Linear``
        saves ``weight.t()``) keeps reading the version it ran on, now the slot. A graph
        that saved the Parameter *itself* (e.g. convolutions, ``x * w``) reads ``p.data``
        when its backward runs, i.e. the new live: run such backwards inside
        ``use(slot)``. In-place writes through a Parameter also bump the autograd version
        counter its old views share; write live through the flat buffers (as the fused
        optimizers do) or ``p.data``.

        The use case (PipeDream weight stashing without a copy per micro-batch): a forward
        runs on live; before the optimizer overwrites live, ``x = new_slot(mb)``, copy
        live into ``x``, ``swap_live(x)``: the forward's graph keeps the old version (slot
        ``x``, pinned until its backward) and the optimizer steps the new live copy.

        On CUDA ``stream`` (default: current) first waits on the device for every pending
        snapshot copy: the one into ``slot`` (its buffer becomes live) and those still
        reading the old live buffer (it becomes the slot's); the slot's copy events are
        then dropped. Other streams using live must be ordered after ``stream``. An L2
        window set by :meth:`set_l2_persistence` stays on the old live address (now the
        slot): call it again to cover the new live buffer.
        """
        self._check_slot(slot)
        if self._using:
            raise ArenaError(
                f"swap_live({slot}) inside arena {self.name!r}'s use(): the parameters point "
                "at a slot right now and use() would point them back at the old live memory "
                "on exit; swap outside use()"
            )
        with self._on_stream(stream) as handle:
            self._core.swap_live(slot, handle)
        with torch.no_grad():
            for b in self._buckets:
                live = list(self._core.param_views(b.index))
                old = b.ptrs
                new = [v.data_ptr() for v in live] if live[0].device.type != "meta" else [0] * len(live)
                for p, view, ptr in zip(b.params, live, old, strict=True):
                    if p.data_ptr() == ptr:
                        p.data = view
                b.live_views = live
                b.ptrs = new
                b.flat_view.param = self._core.bucket_param(b.index)

    def trim_pool(self) -> int:
        """Give the pooled buffers of freed slots back to torch's allocator; returns the
        bytes released. On CUDA the host first waits for the work queued before their
        release (it may still read them) and for snapshot copies still writing them."""
        return int(self._core.trim_pool())

    def snapshot_stream(self) -> int | None:
        """The arena's own CUDA snapshot stream (cudaStream_t as an int), None before its
        first CUDA snapshot, on CPU and in builds without CUDA."""
        if self.device.type != "cuda":
            return None
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return int(self._core.snapshot_stream(index)) or None

    def wait_for_snapshots(self, *, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait for every snapshot copy still reading
        the live weights; call before writing them after ``snapshot(overlap=True)``."""
        if self._evented:
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
        self._using += 1
        try:
            for p, v in zip(self.params, views, strict=False):
                p.data = v
            yield views
        finally:
            self._using -= 1
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

    def release(self, slot: int, microbatch: int, *, stream: Any = None) -> bool:
        """Drop ``microbatch``'s reference; frees the slot at zero. Returns True if freed.

        A freed slot's buffers go to the arena's pool for the next :meth:`snapshot` or
        :meth:`new_slot` (see :meth:`trim_pool`). On CUDA the host never waits: an event is
        recorded on ``stream`` (default: current), and the next user of the buffers, when
        the pool hands them out, waits on the device for it (the work queued there so far)
        and for a snapshot copy still writing the slot, unless they are done already. So
        release on (or after) the stream that last read the slot."""
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
        return bool(self._core.release(slot, mb, self._stream(stream)))

    def free(self, slot: int, *, stream: Any = None) -> None:
        """Free a slot that no micro-batch pins (e.g. a prediction scratch version); its
        buffers go to the pool as in :meth:`release`."""
        self._check_slot(slot)
        self._core.free_slot(slot, self._stream(stream))

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
        """A double buffer for PipeDream-2BW: front = the live weights, back = a new slot
        holding a copy of them (one snapshot). See :class:`DoubleBuffer` for the costs."""
        back = self.snapshot(stream=stream)
        self._core.hold(back)
        return DoubleBuffer(self, back)

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

    # ---- accounting and L2 (engine/arena/l2.py) ---------------------------------------

    def bytes(self) -> dict[str, Any]:
        """Bytes held: ``live`` weights, ``grad`` buffers, all ``slots``, ``per_slot``
        (slot id -> bytes), ``pooled`` (buffers of freed slots kept for reuse, not in
        ``slots``) and the ``peak`` of live + grad + slots so far (padding counted).

        The pool only grows by freeing a slot and a slot is allocated only when the pool is
        empty, so live + grad + slots + pooled never exceeds ``peak``."""
        core = self._core
        return {
            "live": int(core.live_bytes),
            "grad": int(core.grad_bytes),
            "slots": int(core.slot_bytes),
            "pooled": int(core.pooled_bytes),
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
        The window covers the live buffer's address at the time of the call; after
        :meth:`swap_live` call it again.
        """
        return l2.request(self, bucket, hit_ratio, max_bytes, self._stream(stream))

    def clear_l2_persistence(self, *, bucket: int = 0, stream: Any = None) -> None:
        """Remove the window from ``stream`` and give the L2 set-aside back to the device."""
        l2.clear(self, bucket, self._stream(stream))

    def set_l2_window(
        self,
        *,
        share_bytes: int,
        bucket: int | None = None,
        hit_ratio: float = 1.0,
        stream: Any = None,
    ) -> L2Persistence:
        """Like :meth:`set_l2_persistence`, but only the window on ``stream``: the
        device-wide set-aside is left alone, so several stages on one GPU can share it (set it
        once with ``engine.arena.l2.set_aside``). The window marks at most ``share_bytes``
        persisting (``hit_ratio`` is lowered to share / window); ``granted_bytes`` reports
        the share. On CPU (or a CPU-only build) ``supported=False`` with the reason."""
        return l2.window(self, bucket, hit_ratio, share_bytes, self._stream(stream))

    def clear_l2_window(self, *, bucket: int = 0, stream: Any = None) -> None:
        """Remove the window from ``stream`` only; other streams' windows and the
        device-wide set-aside stay."""
        l2.clear(self, bucket, self._stream(stream), set_aside_too=False)
