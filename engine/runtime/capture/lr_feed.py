"""An LR scheduler's values fed to a captured asynchronous window from static slots.

Why: a pb window updates each stage several times (once per update group), and eager steps
the stage's scheduler after every update: the next update (and an in-kernel weight
prediction) reads the new lr. Deferring the steps to after the window would change which lr
those updates read; stepping the scheduler inside the window records its device writes
(``fill_`` of a Tensor lr) with one window's values baked in. So, for Tensor
learning rates only:

* before the window, :meth:`LrFeed.prepare` steps the scheduler ``n`` times on the host --
  exactly the steps eager takes during the window, in order -- copies each resulting lr into
  slot ``i`` of a static buffer, and puts the lr tensors back to their value before;
* inside, the stage's ``i``-th update's scheduler step is ``lr.copy_(slot[i])``
  (:meth:`LrFeed.take`): a device copy a graph replays with whatever the slots hold;
* after, :meth:`LrFeed.finish` checks the count: a window with more updates than slots
  stepped the scheduler itself for the extra ones (exactly eager: the scheduler was at that
  step already); one with fewer (the first window after a ``flush()``) is corrected by
  reloading the scheduler's state and taking the right number of steps.

``n`` is the previous window's count (a steady window's count repeats; a replay's is its
capture's, exact). Bitwise eager: the slots hold the very float32 values eager's ``fill_``
writes, copied, never recomputed.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

__all__ = ["LrFeed", "feed_refusal", "make_feeds"]


def feed_refusal(stage: Any) -> str | None:
    """Why stage ``stage``'s LR scheduler cannot be fed to a captured window (None: it can)."""
    if stage.scheduler is None or stage.bridge is None:
        return None
    if not all(isinstance(g["lr"], Tensor) for g in stage.bridge.opt.param_groups):
        return (f"stage {stage.index}: an LR scheduler of a float lr (a launch argument: each "
                "step would be a new graph, and a replay would not run the scheduler); give "
                "the optimizer lr as a one-element float32 tensor on the stage's device")
    return None


class LrFeed:
    """Per stage: the slots of the scheduler's values for one window (module docstring)."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        self.lrs: list[Tensor] = [g["lr"] for g in stage.bridge.opt.param_groups]
        self.start = [lr.detach().clone() for lr in self.lrs]
        self.slots: list[Tensor] = [lr.new_empty((0,)) for lr in self.lrs]
        self.prepared = 0
        self.used = 0
        self.last = 0  # the previous window's count
        self._saved: Any = None

    def prepare(self, n: int, exact: bool = False) -> None:
        """Step the scheduler ``n`` times into the slots, the lrs back as before. ``exact``:
        the window takes exactly ``n`` steps (a replay): nothing saved for a correction."""
        sched = self.stage.scheduler
        self._saved = None if exact else copy.deepcopy(sched.state_dict())
        lrs = [g["lr"] for g in self.stage.bridge.opt.param_groups]
        if any(a is not b for a, b in zip(lrs, self.lrs, strict=True)):  # (load_state_dict)
            self.lrs = lrs
            self.start = [lr.detach().clone() for lr in lrs]
            self.slots = [lr.new_empty((0,)) for lr in lrs]
        if n > self.slots[0].numel():
            self.slots = [lr.new_empty((n,)) for lr in self.lrs]  # (learning: a new address)
        for s, lr in zip(self.start, self.lrs, strict=True):
            s.copy_(lr)
        for i in range(n):
            sched.step()
            for slot, lr in zip(self.slots, self.lrs, strict=True):
                slot[i].copy_(lr)
        for s, lr in zip(self.start, self.lrs, strict=True):
            lr.copy_(s)
        self.prepared, self.used = n, 0

    def take(self) -> None:
        """One update's scheduler step, inside the window."""
        i = self.used
        if i < self.prepared:
            for slot, lr in zip(self.slots, self.lrs, strict=True):
                lr.copy_(slot[i])
        else:  # more updates than slots: the scheduler is at step i already (eager's)
            self.stage.scheduler.step()
        self.used += 1

    def finish(self) -> None:
        """After a window that ran its Python: fewer updates than slots (a pipeline refilling
        after a flush) takes the scheduler back to the right step."""
        if self.used < self.prepared:
            if self._saved is None:
                raise RuntimeError(f"stage {self.stage.index}: a replayed window took "
                                   f"{self.used} LR scheduler steps of {self.prepared}")
            sched = self.stage.scheduler
            sched.load_state_dict(self._saved)
            for s, lr in zip(self.start, self.lrs, strict=True):
                lr.copy_(s)
            for _ in range(self.used):
                sched.step()
        self.last = self.used
        self.prepared = self.used = 0
        self._saved = None

    def replayed(self) -> None:
        """After a replay (no Python ran): it took every prepared step."""
        self.used = self.prepared
        self.finish()


def make_feeds(stages: list[Any]) -> dict[int, LrFeed]:
    """The feeds of the stages with a scheduler (their refusals checked first)."""
    with torch.no_grad():
        return {st.index: LrFeed(st) for st in stages if st.scheduler is not None and st.bridge is not None}
