"""The engine's own clock: bubble fractions of the actions that actually ran.

Why computed afterwards: ``stats()`` reports the bubble a schedule leaves, once with unit
costs (F = 1, B = 2: the bubble formulas of ALGORITHMS.md hold for any fixed ratio) and once
with each action's measured wall time. Both are a discrete-event replay of the executed
actions: an action starts when its stage is free and its producer (the previous stage's
forward, the next stage's backward) has finished. Doing that replay per action on the hot
path cost ~12 % of a small model's step; here the executor only appends (stage, kind,
micro-batch, seconds) to a preallocated log, and the replay runs in batches (every few thousand actions,
and when ``stats()`` asks).

Inputs count as available at once, so pauses between ``step()`` calls never show up as
bubbles; a synchronous step starts after the previous step's last action (its flush). With
one stage per process the clock sees only its own stage, so no bubble is reported there.
"""

from __future__ import annotations

__all__ = ["Clock"]

_F, _B = 0, 1  # the op codes of engine.runtime.program
_UNIT = {_F: 1.0, _B: 2.0}
_BATCH = 8192


class _Replay:
    def __init__(self, S: int) -> None:
        self.S = S
        self.free = [0.0] * S
        self.busy = [0.0] * S
        self.done: dict[tuple[int, int, int], float] = {}
        self.start: float | None = None
        self.end = 0.0
        self.barrier = 0.0

    def add(self, s: int, op: int, n: int, cost: float) -> None:
        dep = 0.0
        if op == _F and s > 0:
            dep = self.done.pop((s - 1, _F, n), 0.0)
        elif op == _B and s < self.S - 1:
            dep = self.done.pop((s + 1, _B, n), 0.0)
        begin = max(self.free[s], dep, self.barrier)
        if self.start is None:
            self.start = begin
        finish = begin + cost
        self.free[s] = finish
        self.busy[s] += cost
        if finish > self.end:
            self.end = finish
        if (op == _F and s + 1 < self.S) or (op == _B and s > 0):
            self.done[(s, op, n)] = finish

    def bubble(self) -> float:
        if self.start is None or self.end <= self.start:
            return 0.0
        return 1.0 - sum(self.busy) / (self.S * (self.end - self.start))


class Clock:
    """Unit-cost and wall-time replay of the executed forwards and backwards."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.reset()

    def reset(self) -> None:
        # a preallocated log: appending to a growing list would take new memory (and a page
        # fault now and then) in steady state
        self._log: list[tuple[int, int, int, float] | None] = [None] * _BATCH
        self._k = 0
        self._unit = _Replay(self.num_stages)
        self._wall = _Replay(self.num_stages)

    def record(self, stage: int, op: int, n: int, seconds: float) -> None:
        self._log[self._k] = (stage, op, n, seconds)
        self._k += 1
        if self._k == _BATCH:
            self._replay()

    def _replay(self) -> None:
        unit, wall = self._unit, self._wall
        log = self._log
        for k in range(self._k):
            s, op, n, sec = log[k]  # type: ignore[misc]
            unit.add(s, op, n, _UNIT[op])
            wall.add(s, op, n, sec)
            log[k] = None
        self._k = 0

    def barrier(self) -> None:
        """A flush: later actions start after everything so far."""
        self._replay()
        self._unit.barrier = self._unit.end
        self._wall.barrier = self._wall.end

    def bubble(self) -> tuple[float, float]:
        """(unit-cost, wall-time) bubble fractions of everything recorded since the reset."""
        self._replay()
        return self._unit.bubble(), self._wall.bubble()
