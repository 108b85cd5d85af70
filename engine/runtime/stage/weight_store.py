"""A stage's weights: the live buffers in the C++ arena, the versions kept for micro-batches
in flight, and one transient buffer for computed weights.

Why this design (ALGORITHMS.md, "Weight versions"; DESIGN.md, "zero-copy hot path"):

* **Live weights** are the arena's live buffers; the module's parameters are views of them,
  and so are the *shadow* parameters the stage optimizer steps. (In-place updates through the
  shadows or the flat buffers do not bump the module parameters' autograd version counters,
  so graphs saved by forwards in flight stay valid and read the new values: pb's live weights.)
* **Kept versions** (weight stashing, 2BW): a forward that must keep its weights until its
  backward *pins* the version it read. When the optimizer is about to overwrite a pinned (or,
  for 2BW, a still-needed) live version, the store *retires* it instead of copying it per
  micro-batch: it copies live into a pooled slot and swaps the two buffers in O(1)
  (``WeightArena.swap_live``), so the old memory -- which the in-flight forwards' saved tensors
  point at -- becomes a slot, and the optimizer steps the fresh copy. One copy per update that
  needs it, none per micro-batch; a slot goes back to the arena's pool when its last pin is
  released. Stage s of pipedream holds at most S-s versions, 2BW exactly two.
* **The transient** holds computed weights -- a prediction (LWP, SpecTrain) or PipeMare's
  corrected weights -- tagged with what it holds and at which update, so it is computed at most
  once per update (the fused optimizer step writes the forward's prediction into it directly).
  Live-weight methods thus hold one live version plus one transient, whatever the
  recomputation mode (see :mod:`~engine.runtime.stage.saved_weights` for ``checkpoint="never"``).
* **Gradients** accumulate into the arena's flat gradient buffers, which persist: no
  allocation, no copy, no page fault per step.

Buffer ids: ``LIVE`` (-1) is the live buffer; ids >= 0 are arena slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from engine.runtime.stage.fresh_grads import FreshGrads

__all__ = ["LIVE", "WeightStore"]

LIVE = -1

_NONE: list[int] = []

#: a pin handle: ("v", version) for a kept weight version, ("t", slot) for a pinned transient
Pin = tuple[str, int]


class _Use:
    """The context manager of :meth:`WeightStore.use` (a class: it runs around most actions)."""

    __slots__ = ("store", "buf", "previous")

    def __init__(self, store: WeightStore, buf: int) -> None:
        self.store = store
        self.buf = buf
        self.previous = -2

    def __enter__(self) -> None:
        store = self.store
        if self.buf == store._active:
            return
        self.previous = store._active
        store.point(self.buf)

    def __exit__(self, *exc: object) -> None:
        if self.previous != -2:
            self.store.point(self.previous)


class WeightStore:
    """Weight buffers of one stage (see the module docstring).

    Args:
        arena: the stage's ``WeightArena`` (``engine.flatten_`` of the module, bucketed by the
            optimizer's param groups), or None for a stage without parameters.
        params: the module's parameters in arena order.
    """

    def __init__(
        self, arena: Any, params: list[nn.Parameter], shadow: list[nn.Parameter]
    ) -> None:
        self.arena = arena
        self.params = params
        self.shadow = shadow
        self._grad_views: list[Tensor | None] = []
        for sp, p in zip(shadow, params, strict=True):
            sp.data = p.data  # the live views
            sp.grad = p.grad  # the flat gradient views (None for frozen parameters)
            self._grad_views.append(p.grad)
        # which parameters received a gradient since the last update (frozen ones count as
        # used: the optimizer never sees a gradient for them anyway)
        self._used_init = bytes(0 if p.requires_grad else 1 for p in params)
        self._used = bytearray(self._used_init)
        for i, p in enumerate(params):
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._marker(i))
        self.version = 0
        self._live_pins: set[int] = set()
        self._slots: dict[int, dict[str, Any]] = {}  # slot -> {"version", "pins", "held"}
        self._by_version: dict[int, int] = {}
        self._held: int | None = None  # 2BW: version future forwards read
        self._transient: int | None = None
        self._transient_key: Any = None
        self.nbuckets = 0 if arena is None else len(arena.buckets)
        self._live_flats: list[Tensor] = (
            [] if arena is None else [arena.flat_param(b) for b in range(self.nbuckets)]
        )
        self._grad_flats: list[Tensor] = []
        for b in range(self.nbuckets):
            g = arena.flat_grad(b)
            if g is not None:
                self._grad_flats.append(g)
        #: one multi-tensor add per backward instead of one add_ per parameter (GPU)
        self.fresh = FreshGrads(params, self._grad_views)
        self.fresh.stale = self.fresh.enabled  # every group's first backward writes (zero_grads)
        self._views: dict[int, list[Tensor]] = {LIVE: [p.data for p in params]}
        self._flats: dict[int, list[Tensor]] = {}
        self._active = LIVE
        self.peak_buffers = 1
        self.peak_versions = 1
        self.retirements = 0
        #: called after live moved to other memory (an L2 window must follow it)
        self.on_live_moved: Callable[[], Any] | None = None

    # ------------------------------------------------------------------ buffers

    def flats(self, buf: int) -> list[Tensor]:
        """The flat tensors of buffer ``buf``, one per arena bucket."""
        if buf == LIVE:
            return self._live_flats
        flats = self._flats.get(buf)
        if flats is None:
            flats = [self.arena.slot_flat(buf, b) for b in range(self.nbuckets)]
            self._flats[buf] = flats
        return flats

    def slot_flats(self) -> list[Tensor]:
        """The flat tensors of every version slot :meth:`flats` has opened, slot by slot."""
        return [f for flats in self._flats.values() for f in flats]

    def live_flats(self) -> list[Tensor]:
        return self._live_flats

    def grad_flats(self) -> list[Tensor]:
        """Flat gradient buffers of the buckets that hold gradients (fixed for the stage's
        life: gradients never move)."""
        return self._grad_flats

    def views(self, buf: int) -> list[Tensor]:
        v = self._views.get(buf)
        if v is None:
            v = self.arena.slot_views(buf)
            self._views[buf] = v
        return v

    @property
    def active(self) -> int:
        """The buffer the parameters point at right now."""
        return self._active

    def point(self, buf: int) -> None:
        """Point every parameter's ``.data`` at buffer ``buf`` until the next ``point`` (the
        stage's rebase mode keeps its forward buffer between actions; see Stage.settle)."""
        if buf == self._active:
            return
        for p, v in zip(self.params, self.views(buf)):  # noqa: B905 - same length
            p.data = v
        self._active = buf

    def use(self, buf: int) -> _Use:
        """Point every parameter's ``.data`` at buffer ``buf`` for the block (the buffer in
        use already: no-op)."""
        return _Use(self, buf)

    # ------------------------------------------------------------------ kept versions

    def pin_version(self, version: int, mb: int) -> Pin:
        """A forward of ``mb`` reads ``version`` and keeps it until its backward."""
        if self.arena is None:  # a stage without parameters: every version is the same
            return ("v", version)
        if self._held is not None and version > self._held:
            self._hold(None)
        if version == self.version:
            self._live_pins.add(mb)
        else:
            slot = self._by_version.get(version)
            if slot is None:
                raise RuntimeError(
                    f"weight version {version} is no longer kept (live version {self.version}); "
                    "the schedule violates its weight policy"
                )
            self._slots[slot]["pins"].add(mb)
        return ("v", version)

    def pin_transient(self, mb: int) -> Pin:
        """Keep the transient's current content for ``mb``'s backward (SpecTrain's reuse)."""
        assert self._transient is not None
        slot = self._transient
        entry = self._slots.setdefault(slot, {"version": None, "pins": set(), "held": False})
        entry["pins"].add(mb)
        return ("t", slot)

    def resolve(self, pin: Pin) -> int:
        """The buffer a pin's weights live in now (the live buffer may have been retired)."""
        kind, key = pin
        if kind == "t":
            return key
        if self.arena is None:
            return LIVE
        return LIVE if key == self.version else self._by_version[key]

    def release(self, pin: Pin, mb: int) -> None:
        if self.arena is None:
            return
        kind, key = pin
        if kind == "t":
            entry = self._slots.get(key)
            if entry is not None:
                entry["pins"].discard(mb)
                if key != self._transient:
                    self._maybe_free(key)
            return
        if key == self.version:
            self._live_pins.discard(mb)
            return
        slot = self._by_version.get(key)
        if slot is not None:
            self._slots[slot]["pins"].discard(mb)
            self._maybe_free(slot)

    def _hold(self, version: int | None) -> None:
        """Keep ``version`` for future forwards (2BW); the previously held one is released."""
        previous, self._held = self._held, version
        if previous is not None and previous != version:
            self._maybe_free_version(previous)

    def _maybe_free_version(self, version: int) -> None:
        slot = self._by_version.get(version)
        if slot is not None:
            self._maybe_free(slot)

    def _maybe_free(self, slot: int) -> None:
        entry = self._slots[slot]
        if entry["pins"] or (entry["version"] is not None and entry["version"] == self._held):
            return
        if slot == self._active:
            raise RuntimeError(f"weight slot {slot} released while in use")
        del self._slots[slot]
        if entry["version"] is not None:
            self._by_version.pop(entry["version"], None)
        self._views.pop(slot, None)
        self._flats.pop(slot, None)
        self.arena.free(slot)

    def _count(self) -> None:
        held = 1 + len(self._slots) + (1 if self._transient is not None and self._transient not in self._slots else 0)
        if held > self.peak_buffers:
            self.peak_buffers = held
        versions = 1 + len(self._by_version)
        if versions > self.peak_versions:
            self.peak_versions = versions

    def before_update(self, keep_live: bool) -> None:
        """Called before the optimizer overwrites live: retire live when a micro-batch in
        flight pinned it or (``keep_live``, 2BW) a future forward reads it."""
        if self.arena is None:
            return  # no weights to keep
        if self._transient is not None and self._transient in self._slots:
            # SpecTrain's reuse pinned the transient: it becomes a kept slot, a new one
            # receives the next prediction
            self._transient = None
            self._transient_key = None
        if keep_live:
            self._hold(self.version)
        if not self._live_pins and not keep_live:
            return
        arena = self.arena
        slot = arena.new_slot()
        for b in range(self.nbuckets):
            arena.slot_flat(slot, b).copy_(arena.flat_param(b))
        old_views = self._views[LIVE]
        arena.swap_live(slot)
        # the slot id now names the old live memory: its views are the old live views
        self._views[slot] = old_views
        self._flats.pop(slot, None)
        self._views[LIVE] = [p.data for p in self.params]
        self._live_flats = [arena.flat_param(b) for b in range(self.nbuckets)]
        for sp, p in zip(self.shadow, self.params, strict=True):
            sp.data = p.data
        self._slots[slot] = {"version": self.version, "pins": self._live_pins, "held": keep_live}
        self._by_version[self.version] = slot
        self._live_pins = set()
        self.retirements += 1
        self._count()
        if self.on_live_moved is not None:
            self.on_live_moved()

    def finish_update(self, wrote_transient_key: Any) -> None:
        """After the optimizer step: the live version advances; the transient holds what the
        fused step wrote into it (``wrote_transient_key``) or is stale."""
        self.version += 1
        self.zero_grads()
        self._transient_key = (
            (wrote_transient_key, self.version) if wrote_transient_key is not None else None
        )

    # ------------------------------------------------------------------ the transient

    def transient_buffer(self) -> int:
        """The transient's slot id (allocated from the arena's pool on first use)."""
        if self._transient is None:
            self._transient = self.arena.new_slot()
            self._count()
        return self._transient

    def transient(self, key: Any, updates: int, fill: Callable[[int], None]) -> int:
        """The transient holding ``key``'s values at update count ``updates``; ``fill(buf)``
        writes them into buffer ``buf`` when the transient holds something else."""
        buf = self.transient_buffer()
        if self._transient_key != (key, updates):
            with torch.no_grad():
                fill(buf)
            self._transient_key = (key, updates)
        return buf

    def invalidate_transient(self) -> None:
        """The weights changed behind the store's back (load_state_dict): recompute."""
        self._transient_key = None

    def transient_flats(self) -> list[Tensor]:
        return self.flats(self.transient_buffer())

    # ------------------------------------------------------------------ gradients

    def _marker(self, i: int) -> Callable[[Tensor], None]:
        used = self._used

        def mark(_p: Tensor) -> None:
            used[i] = 1

        return mark

    def index_of(self, p: nn.Parameter) -> int:
        """Parameter ``p``'s index in this store (for :meth:`was_used` / :meth:`mark_used`)."""
        for i, q in enumerate(self.params):
            if q is p:
                return i
        raise KeyError("the parameter is not one of this stage's")

    def was_used(self, i: int) -> bool:
        """Whether parameter ``i`` received a gradient since the last update."""
        return bool(self._used[i])

    def mark_used(self, i: int) -> None:
        """Count parameter ``i`` as having a gradient (a tied parameter holding the sum)."""
        self._used[i] = 1

    def unused_params(self) -> list[int]:
        """Indices of trainable parameters that received no gradient since the last update
        (the optimizer must skip them, as torch.optim skips a ``.grad`` of None). Also puts
        back a gradient view a user replaced (e.g. ``module.zero_grad()`` set it to None)."""
        for p, g in zip(self.params, self._grad_views):  # noqa: B905 - same length
            if p.grad is not g:
                self._rebind_grad(p, g)
        if 0 not in self._used:
            return _NONE
        return [i for i, u in enumerate(self._used) if not u]

    @staticmethod
    def _rebind_grad(p: nn.Parameter, view: Tensor | None) -> None:
        if view is None:
            p.grad = None
            return
        with torch.no_grad():
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
        p.grad = view

    def zero_grads(self) -> None:
        """The gradients count as zero from here (after an update, a discarded group). With
        fresh gradients (GPU stages) no launch: the buffer is marked stale and the group's
        first backward writes it (fresh_grads.py) -- so every group's first backward is a
        copy whatever came before, and a captured window replays the same calls; without
        them AccumulateGrad adds in place, so the buffers are zeroed now."""
        self._used[:] = self._used_init
        if self.fresh.enabled:
            self.fresh.stale = True
        else:
            self._zero_now()

    def _zero_now(self) -> None:
        for g in self._grad_flats:
            g.zero_()
        self.fresh.stale = False

    def settle_grads(self) -> None:
        """Before the gradient buffers are read or written outside a backward (the update,
        the tie sum): a stale buffer -- no backward of the group wrote it -- is zeroed."""
        if self.fresh.stale:
            self._zero_now()

    def grad_state(self) -> list[Tensor]:
        """Copies of the flat gradient buffers as they count (zeros while stale)."""
        if self.fresh.stale:
            return [torch.zeros_like(g) for g in self._grad_flats]
        return [g.clone() for g in self._grad_flats]

    def load_grads(self, saved: list[Tensor]) -> None:
        """The flat gradient buffers from :meth:`grad_state` (they then count as written)."""
        with torch.no_grad():
            for g, s in zip(self._grad_flats, saved, strict=True):
                g.copy_(s)
        self.fresh.stale = False

    def scale_grads(self, factor: float) -> None:
        for g in self.grad_flats():
            g.mul_(factor)

    # ------------------------------------------------------------------ recovery and facts

    def release_all(self) -> None:
        """Forget every pin and hold and free the kept versions (rollback, segment end)."""
        self._live_pins.clear()
        self._held = None
        for slot in list(self._slots):
            self._slots[slot]["pins"].clear()
            if slot == self._transient:
                del self._slots[slot]  # stays the transient, no longer kept for anyone
            else:
                self._maybe_free(slot)

    def kept_state(self) -> dict[str, Any]:
        """What an unflushed pipeline's state saves of this store (engine.runtime.state.inflight):
        which parameters got a gradient, the kept versions and pinned transients with their
        content (and the transient's, with the key it was filled for), the transient's slot,
        the micro-batches pinning live and the version 2BW holds."""
        slots = [
            {"slot": slot, "version": entry["version"],
             "flats": [f.clone() for f in self.flats(slot)],
             "pins": sorted(entry["pins"]), "held": bool(entry["held"])}
            for slot, entry in sorted(self._slots.items())
        ]
        t = self._transient
        if t is not None and t not in self._slots and self._transient_key is not None:
            slots.append({"slot": t, "version": None, "flats": [f.clone() for f in self.flats(t)],
                          "pins": None, "held": False, "key": self._transient_key})
        return {"used": list(self._used), "slots": slots, "transient": t,
                "live_pins": sorted(self._live_pins), "held": self._held}

    def load_kept_state(self, sd: dict[str, Any]) -> dict[int, int]:
        """Undo :meth:`kept_state` in a flushed store: the kept buffers go into fresh arena
        slots. Returns saved slot id -> new slot id (the stash's pins name saved ids)."""
        moved: dict[int, int] = {}
        with torch.no_grad():
            self._used[:] = bytes(sd["used"])
            if self.fresh.enabled and self._used == bytearray(self._used_init):
                self.fresh.stale = True  # saved between groups: the next backward writes
            for v in sd["slots"]:
                slot = self.arena.new_slot()
                moved[v["slot"]] = slot
                for dst, src in zip(self.flats(slot), v["flats"], strict=True):
                    dst.copy_(src)
                if v["pins"] is None:  # the transient, holding a prediction or correction
                    self._transient_key = v["key"]
                    continue
                self._slots[slot] = {"version": v["version"], "pins": set(v["pins"]), "held": v["held"]}
                if v["version"] is not None:
                    self._by_version[v["version"]] = slot
        if sd["transient"] is not None and sd["transient"] in moved:
            self._transient = moved[sd["transient"]]
        self._live_pins = set(sd["live_pins"])
        self._held = sd["held"]
        self._count()
        return moved

    @property
    def buffers_held(self) -> int:
        """Weight buffers held now: live, kept versions, the transient."""
        return 1 + len(self._slots) + (
            1 if self._transient is not None and self._transient not in self._slots else 0
        )

    @property
    def versions_held(self) -> int:
        """Distinct weight versions kept now (live included)."""
        return 1 + len(self._by_version)

    def reset_peaks(self) -> None:
        self.peak_buffers = self.buffers_held
        self.peak_versions = self.versions_held

    def bytes(self) -> dict[str, int]:
        """Bytes held by this stage's weights: live, gradients, kept slots + transient, pool."""
        if self.arena is None:
            return {"live": 0, "grad": 0, "slots": 0, "pooled": 0}
        b = self.arena.bytes()
        return {k: int(b.get(k, 0)) for k in ("live", "grad", "slots", "pooled")}
