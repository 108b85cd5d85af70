"""Runs the stages' action streams in one process ("local" transport) and keeps the clock.

The executor owns the *segment* (micro-batches since the last flush), the hand-off mailboxes
between neighbouring stages and the engine's own clock. Local execution order across stages
is free as long as each stage's own order is kept and data dependencies are met, so the loop
simply runs every stage as far as it can until nothing can progress; results do not depend on
where it pauses (see plan.py).

The clock: every action gets a start time max(stage free, producer finished) and a cost, once
with unit costs (F = 1, B = 2; the bubble formulas of ALGORITHMS.md hold for any fixed ratio)
and once with the measured wall time of the action. Inputs count as available at once, so
pauses between ``step()`` calls never show up as bubbles; synchronous steps start after the
previous step's last action (their flush).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from engine.runtime.errors import NonFiniteLossError
from engine.runtime.plan import SYNC_SCHEDULES, Act, stage_stream
from engine.runtime.stage import DROPPED, Stage

__all__ = ["Executor", "Clock"]

_COST = {"F": 1.0, "B": 2.0}


class Clock:
    """Discrete-event clock of one run: busy time per stage and makespan."""

    def __init__(self, S: int) -> None:
        self.S = S
        self.reset()

    def reset(self) -> None:
        self.free = [0.0] * self.S
        self.busy = [0.0] * self.S
        self.done: dict[tuple[int, str, int], float] = {}
        self.start: float | None = None
        self.end = 0.0
        self.barrier = 0.0

    def record(self, s: int, kind: str, n: int, cost: float) -> None:
        dep = 0.0
        if kind == "F" and s > 0:
            dep = self.done.pop((s - 1, "F", n), 0.0)
        elif kind == "B" and s < self.S - 1:
            dep = self.done.pop((s + 1, "B", n), 0.0)
        begin = max(self.free[s], dep, self.barrier)
        if self.start is None:
            self.start = begin
        finish = begin + cost
        self.free[s] = finish
        self.busy[s] += cost
        self.end = max(self.end, finish)
        if (kind == "F" and s < self.S - 1) or (kind == "B" and s > 0):
            self.done[(s, kind, n)] = finish

    def sync_barrier(self) -> None:
        """A flush: the next actions start after everything so far."""
        self.barrier = self.end

    def bubble(self) -> float:
        if self.start is None or self.end <= self.start:
            return 0.0
        span = self.end - self.start
        return 1.0 - sum(self.busy) / (self.S * span)


@dataclasses.dataclass
class _Input:
    x: Tensor
    target: Any
    scale: float
    samples: int


class _Stream:
    """A stage's action stream with one action of look-ahead."""

    def __init__(self, it: Iterator[Act]) -> None:
        self._it = it
        self._next: Act | None = None
        self._done = False

    def peek(self) -> Act | None:
        if self._next is None and not self._done:
            self._next = next(self._it, None)
            self._done = self._next is None
        return self._next

    def advance(self) -> None:
        self._next = None


class Executor:
    """Local execution of one schedule over a list of stages."""

    def __init__(
        self,
        stages: list[Stage],
        schedule: str,
        M: int,
        k: int,
        order: str | None,
        on_nonfinite: str,
    ) -> None:
        self.stages = stages
        self.S = len(stages)
        self.schedule = schedule
        self.sync = schedule in SYNC_SCHEDULES
        self.M = M
        self.k = k
        self.order = order
        self.on_nonfinite = on_nonfinite
        self.unit_clock = Clock(self.S)
        self.wall_clock = Clock(self.S)
        self.n_base = 0  # global id of the next segment's first micro-batch
        self.dropped = 0  # micro-batches whose loss was not finite, over the whole run
        self.active = False
        self._reset_segment()

    # ------------------------------------------------------------------ segments

    def _reset_segment(self) -> None:
        self.inputs: dict[int, _Input] = {}
        self.fed = 0
        self.draining = False
        self.N = 0
        self.acts: dict[tuple[int, int], Tensor] = {}
        self.grads: dict[tuple[int, int], Any] = {}
        self.b_done = [0] * self.S
        self.f_done = [0] * self.S
        self.streams: list[_Stream] = []
        self.losses: list[tuple[int, Tensor, int]] = []
        self.nonfinite: list[int] = []

    def open_segment(self) -> None:
        """Start a new segment: streams restart at micro-batch 0 (fill after a flush)."""
        self._reset_segment()
        for st in self.stages:
            st.segment_updates = st.updates
        self.streams = [
            _Stream(stage_stream(self.schedule, s, self.S, self.M, self.k, self.order))
            for s in range(self.S)
        ]
        self.active = True

    def feed(self, xs: list[Tensor], targets: list[Any], scales: list[float]) -> None:
        for x, t, sc in zip(xs, targets, scales, strict=True):
            self.inputs[self.fed] = _Input(x, t, sc, int(x.shape[0]))
            self.fed += 1

    def in_flight(self) -> int:
        """Micro-batches fed in this segment whose backward has not finished on stage 0, plus
        gradients not yet applied."""
        if not self.active:
            return 0
        pending = any(st.pending for st in self.stages)
        return self.fed - self.b_done[0] + (1 if pending else 0)

    def close_segment(self) -> None:
        self.n_base += self.fed
        self.active = False
        for st in self.stages:
            st.store.unhold_all("2bw")
        self._reset_segment()

    # ------------------------------------------------------------------ running

    def _ready(self, s: int, act: Act) -> bool | None:
        """True: run it; False: blocked; None: skip it (filtered out by the drain)."""
        if act.kind == "U":
            return True if self.stages[s].pending else None
        if self.draining and act.i >= self.N:
            return None
        if act.kind == "F":
            return act.i < self.fed if s == 0 else (s - 1, act.i) in self.acts
        return True if s == self.S - 1 else (s + 1, act.i) in self.grads

    def _finished(self, s: int) -> bool:
        return self.draining and self.b_done[s] >= self.N

    def run(self) -> None:
        """Run every stage as far as it can. Raises NonFiniteLossError (after keeping the
        stage state consistent) when a loss is not finite and on_nonfinite == "raise"."""
        error: NonFiniteLossError | None = None
        progress = True
        while progress:
            progress = False
            for s in range(self.S):
                stream = self.streams[s]
                while not self._finished(s):
                    act = stream.peek()
                    if act is None:
                        break
                    ready = self._ready(s, act)
                    if ready is False:
                        break
                    stream.advance()
                    progress = True
                    if ready is None:
                        continue
                    err = self._execute(s, act)
                    if err is not None and error is None:
                        error = err
                    if error is not None and self.sync:
                        raise error
                if self._finished(s) and self.stages[s].pending and not self.sync:
                    self._execute(s, Act("U"))  # flush: apply the partial group, drop nothing
                    progress = True
            if error is not None:
                raise error

    def _execute(self, s: int, act: Act) -> NonFiniteLossError | None:
        stage = self.stages[s]
        n = self.n_base + act.i
        t0 = time.perf_counter()
        err = None
        if act.kind == "F":
            inp = self.inputs[act.i]
            x = inp.x if s == 0 else self.acts.pop((s - 1, act.i))
            out, loss = stage.forward(act.i, n, x, inp.target, inp.scale)
            self.f_done[s] += 1
            if s < self.S - 1:
                self.acts[(s, act.i)] = out
            else:
                self.losses.append((n, loss, inp.samples))
                del self.inputs[act.i]
                if not bool(torch.isfinite(loss).all()):
                    self.nonfinite.append(n)
                    self.dropped += 1
                    stage.drop(act.i)
                    if self.on_nonfinite == "raise":
                        err = NonFiniteLossError(
                            f"micro-batch {n} (#{act.i} of this {'mini-batch' if self.sync else 'segment'}) "
                            f"gave a non-finite loss ({loss.item()}); "
                            + (
                                "the step was rolled back: no weight or optimizer state changed. "
                                if self.sync
                                else "it was dropped at every stage (zero gradient); earlier updates stand. "
                            )
                            + "Lower the learning rate, check the inputs, or pass on_nonfinite='skip'."
                        )
        elif act.kind == "B":
            grad = None if s == self.S - 1 else self.grads.pop((s + 1, act.i))
            gin = stage.backward(act.i, n, grad)
            self.b_done[s] += 1
            if s > 0:
                self.grads[(s, act.i)] = gin if gin is not None else DROPPED
        else:
            stage.update()
        if act.kind != "U":
            wall = time.perf_counter() - t0
            self.unit_clock.record(s, act.kind, n, _COST[act.kind])
            self.wall_clock.record(s, act.kind, n, wall)
        return err

    def take_losses(self) -> tuple[Tensor | None, list[int]]:
        """Sample-weighted mean loss of the micro-batches computed since the last call."""
        losses, self.losses = self.losses, []
        if not losses:
            return None, []
        total = sum(b for _, _, b in losses)
        value = sum(loss.double() * b for _, loss, b in losses) / total
        return value.float(), [n for n, _, _ in losses]

    def abort(self) -> None:
        """Roll back a failed synchronous step: no gradients, no stashed work."""
        for st in self.stages:
            st.discard_gradients()
            st.reset_in_flight()
        self.close_segment()
