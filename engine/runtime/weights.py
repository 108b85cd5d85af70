"""A stage's weight buffers: the live weights plus version slots that micro-batches pin.

Why this exists: which weights a forward (F) and a backward (B) read is the whole difference
between the schedules of ALGORITHMS.md. Two facts about autograd, verified in
tests/test_runtime_weights.py, decide the design:

* A leaf parameter saved by a custom Function is saved *by reference*: at B time it reads
  whatever storage ``param.data`` points at then. A view saved by a builtin op (``nn.Linear``
  saves ``weight.t()``) keeps the storage F ran on. Running B under the *same* storage F ran
  on (``use(buffer)``) makes both kinds read the same values, and writing the wanted W_B into
  that storage first makes B read exactly W_B.
* Assigning ``param.data`` and writing through another tensor that shares the storage (the
  flat buffer) do not bump the parameter's version counter; in-place ops on the Parameter do,
  and then a later backward raises. So the optimizer of a stage steps *shadow* Parameters
  that share the live flat buffer (see ``optimizer_params``), never the module's own.

Two backends with one interface: ``ArenaWeightStore`` keeps the weights and every version
slot in the engine's C++ ``WeightArena`` (engine/arena.py: aligned flat buffers, slots pinned
per micro-batch and freed at zero pins); ``WeightStore`` is the same in plain torch, used when
the extension is not built (``make_store`` picks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = ["LIVE", "WeightStore", "ArenaWeightStore", "make_store"]

#: Buffer id of the live weights (what the optimizer updates in place).
LIVE = 0


class WeightStore:
    """Live flat weights of one stage plus pooled slots holding other weight versions.

    The module's parameters become views into one flat buffer per dtype (the live buffer).
    A slot is another set of flat buffers with the same layout; ``use(slot)`` points every
    parameter's ``.data`` at the slot for the duration of a F or B. Slots are reference
    counted by pins (micro-batch ids) and named holds (a policy keeping a version for future
    forwards); an unreferenced slot goes back to a pool so steady-state runs do not allocate.
    """

    def __init__(self, module: nn.Module) -> None:
        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self._dtypes: list[torch.dtype] = sorted({p.dtype for p in self.params}, key=str)
        # layout: param index -> (dtype index, offset, numel, shape)
        self._layout: list[tuple[int, int, int, torch.Size]] = []
        sizes = [0] * len(self._dtypes)
        for p in self.params:
            d = self._dtypes.index(p.dtype)
            self._layout.append((d, sizes[d], p.numel(), p.shape))
            sizes[d] += p.numel()
        device = self.params[0].device if self.params else torch.device("cpu")
        live = [
            torch.empty(n, dtype=dt, device=device)
            for n, dt in zip(sizes, self._dtypes, strict=False)
        ]
        for p, (d, off, n, _shape) in zip(self.params, self._layout, strict=False):
            live[d][off : off + n].copy_(p.detach().reshape(-1))
        self._buffers: dict[int, list[Tensor]] = {LIVE: live}
        self._views: dict[int, list[Tensor]] = {LIVE: self._make_views(live)}
        for p, v in zip(self.params, self._views[LIVE], strict=False):
            p.data = v
        self._pins: dict[int, set[int]] = {}
        self._holds: dict[int, set[str]] = {}
        self._version: dict[int, int] = {}  # slot -> weight version it holds (if a snapshot)
        self._pool: list[list[Tensor]] = []
        self._next = 1
        self._active = LIVE
        self.peak_buffers = 1

    # ------------------------------------------------------------------ layout

    def _make_views(self, flats: list[Tensor]) -> list[Tensor]:
        return [flats[d][off : off + n].view(shape) for d, off, n, shape in self._layout]

    def views(self, slot: int = LIVE) -> list[Tensor]:
        """Per-parameter views of ``slot`` (module parameter order)."""
        return self._views[slot]

    def optimizer_params(self) -> list[nn.Parameter]:
        """Fresh Parameters sharing the live storage, for the stage optimizer to step.

        In-place updates on these bump *their* version counters, not the module's, so
        activations saved by in-flight forwards stay valid (the values they read change, which
        is exactly the live-weights semantics of ``pb``)."""
        out = []
        for p, v in zip(self.params, self._views[LIVE], strict=False):
            q = nn.Parameter(v, requires_grad=p.requires_grad)
            out.append(q)
        return out

    # ------------------------------------------------------------------ slots

    def _alloc(self) -> int:
        slot = self._next
        self._next += 1
        if self._pool:
            flats = self._pool.pop()
        else:
            flats = [torch.empty_like(f) for f in self._buffers[LIVE]]
        self._buffers[slot] = flats
        self._views[slot] = self._make_views(flats)
        self._pins[slot] = set()
        self._holds[slot] = set()
        self.peak_buffers = max(self.peak_buffers, len(self._buffers))
        return slot

    def snapshot(self, version: int | None = None) -> int:
        """A new slot holding a copy of the live weights (tagged with ``version``)."""
        slot = self._alloc()
        for dst, src in zip(self._buffers[slot], self._buffers[LIVE], strict=False):
            dst.copy_(src)
        if version is not None:
            self._version[slot] = version
        return slot

    def slot_with(self, values: list[Tensor]) -> int:
        """A new slot holding ``values`` (one tensor per parameter, module order)."""
        slot = self._alloc()
        self.write(slot, values)
        return slot

    def write(self, slot: int, values: list[Tensor]) -> None:
        """Copy ``values`` into ``slot`` through its flat storage (no version-counter bump)."""
        if slot == LIVE:
            raise ValueError("refusing to overwrite the live weights; the optimizer owns them")
        with torch.no_grad():
            for dst, src in zip(self._views[slot], values, strict=True):
                dst.copy_(src)
        self._version.pop(slot, None)

    def copy_live_into(self, slot: int) -> None:
        """Overwrite ``slot`` with the current live weights."""
        for dst, src in zip(self._buffers[slot], self._buffers[LIVE], strict=False):
            dst.copy_(src)
        self._version.pop(slot, None)

    def find_version(self, version: int) -> int | None:
        """The slot that holds a snapshot of weight ``version``, if one is kept."""
        for slot, v in self._version.items():
            if v == version:
                return slot
        return None

    def version_of(self, slot: int) -> int | None:
        """The weight version a snapshot slot holds (None for computed values)."""
        return self._version.get(slot)

    def pin(self, slot: int, microbatch: int) -> None:
        if slot != LIVE:
            self._pins[slot].add(microbatch)

    def release(self, slot: int, microbatch: int) -> None:
        if slot != LIVE:
            self._pins[slot].discard(microbatch)
            self._maybe_free(slot)

    def hold(self, slot: int, name: str) -> None:
        if slot != LIVE:
            self._holds[slot].add(name)

    def unhold(self, slot: int, name: str) -> None:
        if slot != LIVE and slot in self._holds:
            self._holds[slot].discard(name)
            self._maybe_free(slot)

    def unhold_all(self, name: str) -> None:
        for slot in list(self._holds):
            self.unhold(slot, name)

    def _maybe_free(self, slot: int) -> None:
        if slot in self._buffers and not self._pins[slot] and not self._holds[slot]:
            if self._active == slot:
                raise RuntimeError(f"weight slot {slot} released while in use")
            self._pool.append(self._buffers.pop(slot))
            del self._views[slot], self._pins[slot], self._holds[slot]
            self._version.pop(slot, None)

    @contextlib.contextmanager
    def use(self, slot: int) -> Iterator[None]:
        """Point every parameter's ``.data`` at ``slot`` (LIVE is a no-op) for the block."""
        if slot == self._active:
            yield
            return
        previous = self._active
        for p, v in zip(self.params, self._views[slot], strict=False):
            p.data = v
        self._active = slot
        try:
            yield
        finally:
            for p, v in zip(self.params, self._views[previous], strict=False):
                p.data = v
            self._active = previous

    # ------------------------------------------------------------------ facts

    @property
    def slots(self) -> list[int]:
        """Slots currently held (not counting the live buffer)."""
        return [s for s in self._buffers if s != LIVE]

    def versions_held(self, live_version: int) -> int:
        """Distinct weight versions kept: the live one plus every other snapshot version."""
        versions = {live_version}
        for slot in self.slots:
            versions.add(self._version.get(slot, -slot))  # untagged slots are distinct values
        return len(versions)

    def bytes(self) -> int:
        """Bytes of every buffer held, live and slots (pooled free buffers not counted)."""
        return sum(f.numel() * f.element_size() for flats in self._buffers.values() for f in flats)

    def clear_slots(self) -> None:
        """Drop every slot (after a flush or a failed step); the live weights stay."""
        for slot in list(self._buffers):
            if slot != LIVE:
                self._pins[slot].clear()
                self._holds[slot].clear()
                self._maybe_free(slot)


#: micro-batch ids the arena records for named holds (real micro-batch ids are >= 0)
_HOLD_IDS = {"2bw": -1}


class ArenaWeightStore(WeightStore):
    """The WeightStore interface over the C++ ``WeightArena``.

    Slots are arena slots (ids mapped, since LIVE = 0 here); pins are arena pins, and a named
    hold is an arena pin under a negative pseudo micro-batch id, so the arena frees a slot
    exactly when its last reader is done. Gradients stay ordinary tensors: the stage hands them
    to its optimizer's shadow parameters at every update.
    """

    def __init__(self, module: nn.Module) -> None:
        from engine.arena import flatten_

        self.arena = flatten_(module)
        self.params = list(self.arena.params)
        for p in self.params:
            p.grad = None  # unused parameters keep grad None, as in an unpipelined model
        self._live_views = [p.data for p in self.params]
        self._map: dict[int, int] = {}  # our slot id -> arena slot id
        self._version: dict[int, int] = {}
        self._active = LIVE
        self._next = 1
        self.peak_buffers = 1

    def views(self, slot: int = LIVE) -> list[Tensor]:
        if slot == LIVE:
            return self._live_views
        return self.arena.slot_views(self._map[slot])

    def optimizer_params(self) -> list[nn.Parameter]:
        return [
            nn.Parameter(v, requires_grad=p.requires_grad)
            for p, v in zip(self.params, self._live_views, strict=False)
        ]

    def _register(self, aslot: int) -> int:
        slot = self._next
        self._next += 1
        self._map[slot] = aslot
        self.peak_buffers = max(self.peak_buffers, 1 + len(self._map))
        return slot

    def snapshot(self, version: int | None = None) -> int:
        slot = self._register(self.arena.snapshot())
        if version is not None:
            self._version[slot] = version
        return slot

    def slot_with(self, values: list[Tensor]) -> int:
        slot = self._register(self.arena.snapshot())
        self.write(slot, values)
        return slot

    def write(self, slot: int, values: list[Tensor]) -> None:
        if slot == LIVE:
            raise ValueError("refusing to overwrite the live weights; the optimizer owns them")
        with torch.no_grad():
            for dst, src in zip(self.arena.slot_views(self._map[slot]), values, strict=True):
                dst.copy_(src)
        self._version.pop(slot, None)

    def copy_live_into(self, slot: int) -> None:
        self.write(slot, self._live_views)

    def _pin(self, slot: int, mb: int) -> None:
        self.arena.pin(self._map[slot], mb)

    def _unpin(self, slot: int, mb: int) -> None:
        aslot = self._map[slot]
        if mb in self.arena.pins(aslot):
            if self._active == slot and sum(self.arena.pins(aslot).values()) == 1:
                raise RuntimeError(f"weight slot {slot} released while in use")
            if self.arena.release(aslot, mb):
                del self._map[slot]
                self._version.pop(slot, None)

    def pin(self, slot: int, microbatch: int) -> None:
        if slot != LIVE:
            self._pin(slot, microbatch)

    def release(self, slot: int, microbatch: int) -> None:
        if slot != LIVE and slot in self._map:
            self._unpin(slot, microbatch)

    def hold(self, slot: int, name: str) -> None:
        if slot != LIVE and _HOLD_IDS[name] not in self.arena.pins(self._map[slot]):
            self._pin(slot, _HOLD_IDS[name])

    def unhold(self, slot: int, name: str) -> None:
        if slot != LIVE and slot in self._map:
            self._unpin(slot, _HOLD_IDS[name])

    def unhold_all(self, name: str) -> None:
        for slot in list(self._map):
            self.unhold(slot, name)

    @contextlib.contextmanager
    def use(self, slot: int) -> Iterator[None]:
        if slot == self._active:
            yield
            return
        previous = self._active
        self._active = slot
        try:
            if slot == LIVE:
                saved = [p.data for p in self.params]
                for p, v in zip(self.params, self._live_views, strict=False):
                    p.data = v
                try:
                    yield
                finally:
                    for p, v in zip(self.params, saved, strict=False):
                        p.data = v
            else:
                with self.arena.use(self._map[slot]):
                    yield
        finally:
            self._active = previous

    @property
    def slots(self) -> list[int]:
        return list(self._map)

    def bytes(self) -> int:
        b = self.arena.bytes()
        return int(b["live"]) + int(b["slots"])

    def clear_slots(self) -> None:
        for slot in list(self._map):
            aslot = self._map[slot]
            for mb, count in self.arena.pins(aslot).items():
                for _ in range(count):
                    if self.arena.release(aslot, mb):
                        break
            if self.arena.slots and aslot in self.arena.slots:
                self.arena.free(aslot)
            self._map.pop(slot, None)
            self._version.pop(slot, None)


def make_store(module: nn.Module, backend: str = "auto") -> WeightStore:
    """``"arena"``: the C++ WeightArena; ``"torch"``: plain torch buffers; ``"auto"``: the
    arena when the extension is importable, else torch."""
    if backend == "torch":
        return WeightStore(module)
    if backend == "arena":
        return ArenaWeightStore(module)
    try:
        import engine._C  # noqa: F401
    except ImportError:
        return WeightStore(module)
    if not any(True for _ in module.parameters()):
        return WeightStore(module)  # nothing to flatten
    try:
        return ArenaWeightStore(module)
    except (ValueError, TypeError):  # the arena validates before moving anything (ArenaError)
        return WeightStore(module)
