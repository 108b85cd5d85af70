"""PipeDream-2BW's double buffer: the live weights (front) and one held slot (back).

Why live + one slot and not two slots: 2BW keeps exactly two weight versions, the one the
optimizer steps and the one in-flight backward passes still need. Forwards and the
optimizer work on the live buffers (the modules' parameters themselves), so the front *is*
live; only the other version needs a slot. A swap exchanges the two buffers' memory
through :meth:`WeightArena.swap_live`, so the version in-flight graphs saved views of
becomes the back slot without a byte moving, and the parameters point at the other one.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from engine.arena.core import SlotError


class SwappableArena(Protocol):
    """What a double buffer uses of its :class:`~engine.arena.weight_arena.WeightArena`
    (a Protocol: weight_arena imports this module, so naming the class closes a circle)."""

    name: str
    device: Any
    _core: Any
    _evented: bool

    def swap_live(self, slot: int, *, stream: Any = None) -> None: ...
    def pins(self, slot: int) -> dict[int, int]: ...
    def live_views(self) -> list[torch.Tensor]: ...
    def slot_views(self, slot: int) -> list[torch.Tensor]: ...
    def _on_stream(self, stream: Any) -> AbstractContextManager[int]: ...
    def _stream(self, stream: Any) -> int: ...


class DoubleBuffer:
    """``front`` = the live weights (``p.data`` of every parameter), ``back`` = one slot.

    What each operation costs:

    * :meth:`swap` is ``arena.swap_live(back)``: no bytes move and nothing is allocated;
      C++ exchanges one tensor handle per bucket and Python re-points ``p.data`` of every
      parameter (O(parameters) pointer work). On CUDA the stream first waits on the device
      for pending snapshot copies (e.g. a ``refresh_back(overlap=True)``); the host never
      blocks.
    * :meth:`refresh_back` copies live into the back slot: one memcpy per bucket, the only
      operation here that moves bytes.
    * Creating the buffer (:meth:`WeightArena.rotation`) takes one snapshot of live.

    Typical 2BW use, at a version boundary: ``db.refresh_back()`` (back = a copy of the
    current version), ``db.swap()`` (live = that copy, back = the memory the in-flight
    graphs saved views of; pin ``db.back`` for them), then the optimizer steps live in
    place. Graphs that saved a Parameter object itself (not a view of it) read ``p.data``
    at backward time; run their backward inside ``arena.use(db.back)`` (see
    :meth:`WeightArena.swap_live`).

    The back slot is held: its last ``release`` does not free it and ``arena.free`` refuses
    it; :meth:`close` gives it up.
    """

    def __init__(self, arena: SwappableArena, back: int) -> None:
        self._arena = arena
        self._back = back
        self._closed = False

    @property
    def back(self) -> int:
        """Slot id of the other version (held by this buffer; micro-batches may pin it)."""
        if self._closed:
            raise SlotError(f"the double buffer of arena {self._arena.name!r} is closed")
        return self._back

    def swap(self, *, stream: Any = None) -> None:
        """Exchange live and back by memory (``WeightArena.swap_live``); no bytes move."""
        self._arena.swap_live(self.back, stream=stream)

    def refresh_back(self, *, stream: Any = None, overlap: bool = False) -> None:
        """Copy the live weights into the back slot (on CUDA on the arena's snapshot stream,
        with the same ``overlap`` contract as :meth:`WeightArena.snapshot`).

        Refused (SlotError) while micro-batches pin the back slot: they still read it.
        """
        arena = self._arena
        back = self.back
        pins = arena.pins(back)
        if pins:
            held = ", ".join(map(str, sorted(pins)))
            raise SlotError(
                f"back slot {back} of arena {arena.name!r} is pinned by micro-batch(es) "
                f"{held}, which still read it; release them before refresh_back()"
            )
        with arena._on_stream(stream) as handle:
            arena._core.refresh(back, handle)
            if not overlap and arena._evented:
                arena._core.wait(back, handle)

    def front_views(self) -> list[torch.Tensor]:
        """The live weights, one view per parameter in arena order."""
        return self._arena.live_views()

    def back_views(self) -> list[torch.Tensor]:
        """The back slot's weights, one view per parameter in arena order."""
        return self._arena.slot_views(self.back)

    def close(self, *, stream: Any = None) -> None:
        """Give up the back slot: freed now unless micro-batches still pin it (then their
        last release frees it). Live stays as it is. Closing twice is a no-op."""
        if self._closed:
            return
        self._closed = True
        arena = self._arena
        arena._core.unhold(self._back, arena._stream(stream))
