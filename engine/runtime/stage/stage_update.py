"""A stage's update: the group's gradient made final, clipped, stepped; and its recovery.

Why a module of its own: what happens between a stage's last backward of an update group and
the next group -- renormalising a partial group, the data-parallel mean, gradient clipping
(:mod:`~engine.runtime.exec.clipping`), the optimizer step, the bookkeeping of delays, and
forgetting a group on rollback -- is one concept, separate from running forwards and
backwards (:mod:`~engine.runtime.stage.stage`, which mixes this in).
"""

from __future__ import annotations

import contextlib
import math
from time import perf_counter_ns
from typing import Any

from torch.profiler import record_function

from engine.runtime.stage import labels
from engine.runtime.stage import trace as _trace
from engine.runtime.stage.policy import Transient

__all__ = ["StageUpdates"]

_NULL = contextlib.nullcontext()


class StageUpdates:
    """Mixin of :class:`~engine.runtime.stage.stage.Stage` (uses its store, bridge and counters)."""

    store: Any
    bridge: Any
    policy: Any
    index: int
    updates: int
    pending: int
    pending_weight: float
    pending_mbs: list[int]
    delay_counts: dict[int, int]
    skipped_updates: int
    trace: bool
    records: dict[int, dict[str, Any]]
    grad_hook: Any
    clipper: Any
    loss_scaler: Any
    scheduler: Any
    defer_scheduler: bool
    scheduler_owed: int
    lr_feed: Any
    _prepared: bool
    busy_ns: int
    versions_read: dict[int, int]
    _trivial: Any  # Stage._trivial

    # ------------------------------------------------------------------ update

    def update(self, expected_weight: float | None = 1.0) -> None:
        """U: apply the accumulated gradient (mean over the coalesced samples) and advance t.

        Gradients were accumulated with each micro-batch's loss scaled so that a full group
        sums to the mean loss; a partial group (flush) or one with dropped micro-batches is
        renormalised by the weight that actually arrived, so no gradient is silently lost or
        double counted. A group in which nothing arrived applies no step (t still advances:
        the schedule's version numbering does not depend on what was dropped)."""
        label = record_function(f"stage{self.index}/U{self.updates}") if labels.profiling() else _NULL
        tl = _trace.ACTIVE
        t0 = perf_counter_ns()
        if tl is not None:
            mbs, name = list(self.pending_mbs), f"stage{self.index}/U{self.updates}"
        with label:
            store = self.store
            policy = self.policy
            self._settle()  # a group no backward wrote reads zeros (fresh_grads.py)
            store.before_update(policy.keep_live_at_update(self))
            w = self.pending_weight
            written = None
            if w > 0.0 and self.bridge is not None:  # (no bridge: a stage without parameters)
                if not self._prepared:
                    self.prepare_grads(expected_weight)
                self._prepared = False
                scaler = self.loss_scaler  # float16 (precision.py): a synchronous step unscaled all
                if scaler is not None and not scaler.synchronous:
                    scaler.unscale_group(self)
                if self.clipper is not None:
                    self.clipper.apply(self)
                # a torch.optim optimizer skips on the host (synchronous float16 only)
                if scaler is None or self.bridge.is_engine or not scaler.skip_on_host():
                    key = policy.prediction_key(self)
                    if key is not None and self._trivial(Transient(*key)):
                        key = None  # the forward reads the live weights: nothing to predict
                    written = self.bridge.step(store, key)
                if self.scheduler is not None:
                    if self.defer_scheduler:  # stepped after the captured window
                        self.scheduler_owed += 1
                    elif self.lr_feed is not None:  # a captured asynchronous window's slots
                        self.lr_feed.take()
                    else:
                        self.scheduler.step()
            elif w <= 0.0:
                self.skipped_updates += 1
            elif self.loss_scaler is not None and not self.loss_scaler.synchronous:
                self.loss_scaler.unscale_group(self)  # no parameters: its scale still moves
            store.finish_update(written)
            self._account(self.pending_mbs)
            self.updates += 1
            self.pending = 0
            self.pending_weight = 0.0
            self.pending_mbs = []
        self.busy_ns += perf_counter_ns() - t0
        if tl is not None:
            tl.add(self.index, name, "update", t0, {"micro_batches": mbs, "version": self.updates})

    def prepare_grads(self, expected_weight: float | None = 1.0) -> None:
        """The update's gradient, final before the optimizer (or a global clip) reads it:
        renormalised by the weight that arrived, then the data-parallel mean (``grad_hook``).
        A synchronous update phase runs this on every stage before the global norm."""
        w = self.pending_weight
        if w <= 0.0 or self.bridge is None:
            return
        self._settle()
        if expected_weight is not None and not math.isclose(w, expected_weight, rel_tol=1e-9):
            self.store.scale_grads(expected_weight / w)
        if self.grad_hook is not None:
            self.grad_hook(self.store.grad_flats())
        self._prepared = True

    def _settle(self) -> None:
        """Gradients and skip flags as they count before anything reads them: stale ones
        (an update left them for the next group's first backward to write) are zeroed."""
        self.store.settle_grads()
        if self.bridge is not None and self.bridge.skip is not None:
            self.bridge.skip.settle()

    def _account(self, mbs: list[int]) -> None:
        for n in mbs:
            d = self.updates - self.versions_read.pop(n, self.updates)
            self.delay_counts[d] = self.delay_counts.get(d, 0) + 1
            if self.trace:
                self.records.setdefault(n, {})["update"] = self.updates

    # ------------------------------------------------------------------ recovery

    def discard_gradients(self) -> None:
        """Forget the accumulated gradients (a rolled-back or skipped synchronous step, or a
        backward that failed halfway: its partial sums cannot be told apart)."""
        self.store.zero_grads()
        self.pending_weight = 0.0
        self._prepared = False
        if self.bridge is not None and self.bridge.skip is not None:
            self.bridge.skip.clear()

    def forget_pending(self) -> None:
        """Forget the pending group entirely (a rolled-back synchronous step)."""
        self.discard_gradients()
        for n in self.pending_mbs:
            self.versions_read.pop(n, None)
        self.pending = 0
        self.pending_mbs = []
