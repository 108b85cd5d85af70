"""Activations a stage holds between a micro-batch's forward and its backward.

Why a class: the activation peak (micro-batches held at once) is one of the facts a schedule
promises (gpipe M; 1f1b/pipedream/2bw at most S-s; pb 2(S-1-s)+1) and ``stats()`` reports it,
so every put/pop goes through one place that counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["StashEntry", "ActivationStash", "DROPPED"]


class _Dropped:
    """Marker passed on instead of an activation or a gradient of a dropped micro-batch."""

    def __repr__(self) -> str:
        return "DROPPED"


DROPPED = _Dropped()


@dataclasses.dataclass
class StashEntry:
    """What B(i) needs: the stage input (a leaf the input gradient lands in), the forward's
    output (or scaled loss at the last stage) whose graph the backward runs, the weight
    version the forward pinned (None when it read live or transient weights), the update
    count the forward read, the loss scale, whether the micro-batch was dropped, and the
    weight buffer the forward ran on."""

    i: int
    x: Any
    out: Any  # a tensor, or a tree's leaves that require grad (a list); None when dropped
    pin: Any
    t_f: int
    scale: float
    dropped: bool = False
    buf: int = -1  # the weight buffer the forward ran on (-1: live)
    target: Any = None  # the last stage's target (a resumed pipeline re-runs the forward)
    flag: Any = None  # on_nonfinite="skip_update": the loss's device flag (1.0: not finite)


class ActivationStash:
    """Per-stage map micro-batch -> StashEntry with peak accounting."""

    def __init__(self) -> None:
        self._entries: dict[int, StashEntry] = {}
        self.peak = 0

    def put(self, entry: StashEntry) -> None:
        if entry.i in self._entries:
            raise RuntimeError(f"micro-batch {entry.i} is already stashed")
        self._entries[entry.i] = entry
        if len(self._entries) > self.peak:
            self.peak = len(self._entries)

    def pop(self, i: int) -> StashEntry:
        return self._entries.pop(i)

    def get(self, i: int) -> StashEntry | None:
        return self._entries.get(i)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[StashEntry]:
        return list(self._entries.values())

    def clear(self) -> None:
        self._entries.clear()
