"""Non-finite losses of asynchronous schedules as device flags (``on_nonfinite="skip_update"``).

Why: ``"skip"`` drops a micro-batch with a non-finite loss at every stage, which needs the
loss on the host the moment its forward ends -- one host synchronisation per micro-batch, a
stall of the whole CPU-side schedule on a GPU. Here the last stage turns each loss into a
0-dim float32 flag on its device (1.0: not finite) and nothing is read back:

* the flag rides on the micro-batch's stash entry at every stage; when a stage's backward of
  that micro-batch runs, the flag is added to the stage's accumulator (:class:`SkipFlags`, one
  persistent 0-dim tensor, the same object every step so a CUDA graph can capture it);
* the stage's update hands the accumulator to the optimizer as AMP's ``found_inf``
  (``opt.step(found_inf=...)``): engine.optim skips the whole update -- weights and state --
  on the device when it is non-zero; then the accumulator counts as cleared (the group's
  first flag is copied in, not added: no zero_ per update), the gradient buffers likewise
  (fresh_grads.py), and the update count advances;
* under gloo/NCCL (one stage per process) the flag travels from the last stage to the first
  as one more 1-element message with each micro-batch's gradient (transport/p2p.py), still on
  the device; with data-parallel replicas the accumulators are averaged with the gradients
  before the update, so every replica skips the same updates and the replicas stay equal;
* the counters behind ``stats()`` (non-finite micro-batches, skipped updates per stage) are
  device tensors too, read back in one transfer when ``stats()`` asks (:meth:`DeviceFlags.fold`).

An update group of one micro-batch (pb) thus equals dropping it; a larger group is skipped
whole (GradScaler's semantics), where ``"skip"`` would renormalise the rest of the group.
docs/ALGORITHMS.md, "Non-finite losses".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from engine.errors import PipelineConfigError

if TYPE_CHECKING:
    from engine.schedule.spec import ScheduleSpec

__all__ = ["DeviceFlags", "SkipFlags", "check_skip_update"]


class FlaggedStage(Protocol):
    """What the flags read of a stage: its stash (entries take the flag) and its optimizer
    bridge (which holds the :class:`SkipFlags`). A Protocol, not ``Stage``: the stage's
    optimizer bridge imports this module, so naming ``Stage`` here closes an import circle."""

    stash: Any
    bridge: Any


class SkipFlags:
    """One stage's accumulator of the flags in its pending update group and its count of
    updates skipped on the device (both persistent 0-dim float32 tensors)."""

    def __init__(self, device: torch.device) -> None:
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.skipped = torch.zeros((), dtype=torch.float32, device=device)
        #: found_inf holds a consumed or discarded group's sum (not zeroed): the next flag
        #: writes it (so every group's first flag is a copy)
        self.stale = True
        #: found_inf is one micro-batch's flag as :meth:`DeviceFlags.mark` made it, 0.0 or
        #: 1.0 (the group's only flag, not averaged over replicas): the skip count adds it
        #: as it is, one launch instead of ``ne`` and ``add_`` (pb's groups of one)
        self.single = False

    def add(self, flag: Tensor) -> None:
        """A backward of a flagged (or clean: 0.0) micro-batch joined the pending group: the
        group's first flag is copied in (``0 + flag`` without the zero_), later ones added."""
        # (with stage streams the flag was made on the last stage's stream: the executor
        # holds its storage until every stage stream is past this add, StageStreams.shared)
        flag = flag.to(self.found_inf.device, non_blocking=True)
        if self.stale:
            self.stale = False
            self.single = True
            self.found_inf.copy_(flag)
        else:
            self.single = False
            self.found_inf.add_(flag)

    def averaged(self) -> None:
        """The data-parallel mean took the accumulator (a fraction where one replica flagged)."""
        self.single = False

    def after_step(self) -> None:
        """The optimizer consumed the accumulator: count a skip; the next group starts clean."""
        self.skipped.add_(self.found_inf if self.single else self.found_inf.ne(0))
        self.clear()

    def clear(self) -> None:
        """The next group starts clean (after a step; a failed backward discarded the
        pending gradients, and so their flags): no zero_ launch, the accumulator is marked
        stale and the group's first :meth:`add` writes it."""
        self.stale = True

    def settle(self) -> None:
        """Before the accumulator is read outside a backward (the update, the data-parallel
        mean): a group no flag reached reads zero."""
        if self.stale:
            self.found_inf.zero_()
            self.stale = False
            self.single = False

    def state(self) -> Tensor:
        """A copy of the accumulator as it counts (zero while stale)."""
        return torch.zeros_like(self.found_inf) if self.stale else self.found_inf.clone()

    def load(self, saved: Tensor) -> None:
        """The accumulator from :meth:`state` (into the persistent tensor itself)."""
        self.found_inf.copy_(saved)
        self.stale = False
        self.single = False


class DeviceFlags:
    """The executor's side: flags every stage's stash entry of a micro-batch whose loss the
    last stage just computed, counts non-finite losses on the device, folds the counters."""

    def __init__(self) -> None:
        self.nonfinite: Tensor | None = None  # created on the first loss's device

    def mark(self, stages: list[FlaggedStage], i: int, loss: Tensor) -> Tensor:
        """Flag micro-batch ``i`` (segment id) at every local stage: no host read. Returns
        the flag (read later on every stage's stream)."""
        if loss.dim() == 0 and loss.dtype == torch.float32:
            # x - x is 0 for every finite x and NaN for inf/NaN: two launches, not eight
            flag = loss.detach().sub(loss.detach()).ne_(0)
        else:
            flag = torch.isfinite(loss).all().logical_not().to(torch.float32)
        if self.nonfinite is None:
            self.nonfinite = torch.zeros((), dtype=torch.float32, device=flag.device)
        self.nonfinite.add_(flag)
        for st in stages:
            e = st.stash.get(i)
            if e is not None:  # (its backward comes later at every stage)
                e.flag = flag
        return flag

    def fold(self, stages: list[FlaggedStage]) -> tuple[int, list[int]]:
        """(non-finite losses, skipped updates per stage) since the last fold, in one host
        read; the device counters restart from zero. Call after the stage streams joined."""
        counters: list[Tensor] = [] if self.nonfinite is None else [self.nonfinite]
        counters += [st.bridge.skip.skipped for st in stages if _flags_of(st) is not None]
        if not counters:
            return 0, [0] * len(stages)
        dev = counters[0].device
        values = [int(v) for v in torch.stack([c.to(dev) for c in counters]).tolist()]
        for c in counters:
            c.zero_()
        bad = values.pop(0) if self.nonfinite is not None else 0
        skipped = [values.pop(0) if _flags_of(st) is not None else 0 for st in stages]
        return bad, skipped


def _flags_of(st: FlaggedStage) -> SkipFlags | None:
    return st.bridge.skip if st.bridge is not None else None


def check_skip_update(spec: ScheduleSpec, bridges: list[Any]) -> bool:
    """Whether ``on_nonfinite="skip_update"`` runs as device flags (asynchronous schedules;
    synchronous ones check the step's losses once before the update phase, as ``"skip"``);
    refuses what it cannot do, before any step."""
    if spec.synchronous:
        return False
    for s, bridge in enumerate(bridges):
        if bridge is not None and bridge.opt is not None and not bridge.is_engine:
            raise PipelineConfigError(
                f"on_nonfinite='skip_update': stage {s}'s optimizer is a "
                f"{type(bridge.opt).__module__}.{type(bridge.opt).__qualname__}, which takes no "
                "found_inf to skip its update on the device; use an engine.optim optimizer "
                "(e.g. optimizer=lambda p: engine.optim.SGD(p, lr=0.1)) or on_nonfinite='skip'"
            )
    return True

