"""The engine's own clock: bubble fractions of the actions that actually ran.

Why computed afterwards: ``stats()`` reports the bubble a schedule leaves, once with unit
costs (F = 1, B = 2, or B = W = 1 for a split backward, and B = 2 for the unsplit backwards of a
schedule that splits only some, as DualPipeV does: the bubble formulas of ALGORITHMS.md
hold for any fixed ratio) and once with each action's measured wall time. Both are a discrete-event replay of the executed
actions: an action starts when its stage is free and its producer (the previous stage's
forward, the next stage's backward) has finished. Doing that replay per action on the hot
path cost ~12 % of a small model's step; here the executor only appends (stage, kind,
micro-batch, seconds) to a preallocated log, and the replay runs in batches (every few thousand actions,
and when ``stats()`` asks).

Inputs count as available at once, so pauses between ``step()`` calls never show up as
bubbles; a synchronous step starts after the previous step's last action (its flush). With
one stage per process the clock sees only its own stage, so no bubble is reported there.
With virtual stages (interleaved 1F1B) the resource is the rank: stage s waits for rank
s % ranks to be free, so the bubble is per rank as in the analysis.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["Clock"]

_F, _B, _W = 0, 1, 8  # the op codes of engine.runtime.exec.program
_UNIT = {_F: 1.0, _B: 2.0}
#: a backward split into B and W: the input gradient and the weight gradient one unit each,
#: as engine.schedule's cost model charges them (the whole backward still costs 2)
_UNIT_SPLIT = {_F: 1.0, _B: 1.0, _W: 1.0}
_BATCH = 8192


def _dependency(S: int, s: int, op: int, n: int) -> tuple[int, int, int] | None:
    """The action on another stage that (s, op, n) waits for (as the replay charges it)."""
    if op == _F and s > 0:
        return (s - 1, _F, n)
    if op == _B and s < S - 1:
        return (s + 1, _B, n)
    return None


class _Replay:
    """Both replays (unit costs and wall time) in one pass: per action one call, one dict
    lookup, instead of one per cost model (the sync steps' flush replays every step)."""

    def __init__(
        self,
        S: int,
        split: bool = False,
        ranks: int | tuple[int, ...] | None = None,
        whole: tuple[frozenset[int], ...] | None = None,
        chunks: int = 1,
        pairs: dict[tuple[int, int, int], tuple[int, int, int]] | None = None,
        period: int = 1,
    ) -> None:
        self.S = S
        # overlapped pairs (DualPipeV's F;B): first half (stage, op, micro-batch % period) ->
        # its second half. The pair starts when both halves can (engine.schedule.simulate):
        # a first half is held until its partner arrives in the log, then both replay
        self.pairs = pairs
        self.period = period
        self.held: dict[int, tuple[int, int, int, float]] = {}  # lane -> a held first half
        # per stage, micro-batches (index within a step) whose B is a whole backward (cost 2)
        # in a schedule that splits only some (DualPipeV); None: the split decides for all
        self.whole = whole
        self.chunks = chunks
        # lanes: a stage runs on lane s % L, or on rank_of[s] for a placement such as the V
        self.L = S if ranks is None else ranks if isinstance(ranks, int) else max(ranks) + 1
        self.rank_of = [s % self.L for s in range(S)] if not isinstance(ranks, tuple) else list(ranks)
        self.unit = _UNIT_SPLIT if split else _UNIT
        self.free_u = [0.0] * self.L
        self.free_w = [0.0] * self.L
        self.busy_u = [0.0] * self.L
        self.busy_w = [0.0] * self.L
        self.done: dict[tuple[int, int, int], tuple[float, float]] = {}
        self.start: tuple[float, float] | None = None
        self.end_u = 0.0
        self.end_w = 0.0
        self.barrier_u = 0.0
        self.barrier_w = 0.0

    def run(self, log: list[tuple[int, int, int, float] | None], k: int) -> None:
        S = self.S
        free_u, free_w, done = self.free_u, self.free_w, self.done
        bu, bw = self.barrier_u, self.barrier_w
        end_u, end_w = self.end_u, self.end_w
        busy_u, busy_w = self.busy_u, self.busy_w
        unit = self.unit
        rank_of = self.rank_of
        whole, M = self.whole, self.chunks
        entries = self._plain(log, k) if self.pairs is None else self._paired(log, k)
        for s, op, n, sec, lo_u, lo_w in entries:
            cost = unit[op]
            if whole is not None and op == _B and n % M in whole[s]:
                cost = 2.0  # a B with no W of its own: the whole backward
            dep: tuple[float, float] | None = None
            if op == _F:
                if s > 0:
                    dep = done.pop((s - 1, _F, n), None)
            elif op == _B and s < S - 1:  # (a W waits for nothing on another stage)
                dep = done.pop((s + 1, _B, n), None)
            r = rank_of[s]
            a, b = free_u[r], free_w[r]
            if a < bu:
                a = bu
            if b < bw:
                b = bw
            if a < lo_u:  # the first half of a pair waits for its partner's input
                a = lo_u
            if b < lo_w:
                b = lo_w
            if dep is not None:
                if dep[0] > a:
                    a = dep[0]
                if dep[1] > b:
                    b = dep[1]
            if self.start is None:
                self.start = (a, b)
            a += cost
            b += sec
            free_u[r] = a
            free_w[r] = b
            busy_u[r] += cost
            busy_w[r] += sec
            if a > end_u:
                end_u = a
            if b > end_w:
                end_w = b
            if (op == _F and s + 1 < S) or (op == _B and s > 0):
                done[(s, op, n)] = (a, b)
        self.end_u, self.end_w = end_u, end_w

    @staticmethod
    def _plain(
        log: list[tuple[int, int, int, float] | None], k: int
    ) -> Iterator[tuple[int, int, int, float, float, float]]:
        for j in range(k):
            s, op, n, sec = log[j]  # type: ignore[misc]
            log[j] = None
            yield s, op, n, sec, 0.0, 0.0

    def _paired(
        self, log: list[tuple[int, int, int, float] | None], k: int
    ) -> Iterator[tuple[int, int, int, float, float, float]]:
        """The log's entries with every overlapped pair's first half moved to just before
        its second and given a floor: when the second half's input is ready. A first half
        that another action needs before its partner arrives replays without the floor."""
        S, pairs, P, held, done = self.S, self.pairs, self.period, self.held, self.done
        assert pairs is not None
        seconds = {v: key for key, v in pairs.items()}
        for j in range(k):
            s, op, n, sec = log[j]  # type: ignore[misc]
            log[j] = None
            key = (s, op, n % P)
            r = self.rank_of[s]
            if key in pairs:
                held[r] = (s, op, n, sec)
                continue
            dep = _dependency(S, s, op, n)
            h = held.get(r)
            if h is not None and seconds.get(key) == (h[0], h[1], h[2] % P):
                del held[r]
                lo = done.get(dep, (0.0, 0.0)) if dep is not None else (0.0, 0.0)
                yield (*h, *lo)
            else:
                for r2, h2 in list(held.items()):  # needed before its partner came
                    if r2 == r or (dep is not None and dep == h2[:3]):
                        del held[r2]
                        yield (*h2, 0.0, 0.0)
            yield (s, op, n, sec, 0.0, 0.0)

    def flush_held(self) -> None:
        """Replay first halves still waiting for a partner (at a flush, none should)."""
        rest = list(self.held.values())
        self.held.clear()
        if rest:
            pairs, self.pairs = self.pairs, None
            self.run(rest, len(rest))  # type: ignore[arg-type]
            self.pairs = pairs

    def bubbles(self) -> tuple[float, float]:
        if self.start is None:
            return 0.0, 0.0
        out = []
        for begin, end, busy in ((self.start[0], self.end_u, self.busy_u),
                                 (self.start[1], self.end_w, self.busy_w)):
            out.append(0.0 if end <= begin else 1.0 - sum(busy) / (self.L * (end - begin)))
        return out[0], out[1]


class Clock:
    """Unit-cost and wall-time replay of the executed forwards and backwards."""

    def __init__(
        self,
        num_stages: int,
        split: bool = False,
        ranks: int | tuple[int, ...] | None = None,
        split_only: tuple[frozenset[int], ...] | None = None,
        chunks: int = 1,
    ) -> None:
        self.num_stages = num_stages
        self.split = split  # the schedule splits backwards into B and W (unit costs 1 + 1)
        self.ranks = ranks  # virtual stages: stage s on rank s % ranks (or ranks[s], a placement)
        # a schedule that splits only some backwards (DualPipeV): per stage the split ones
        # (index within a step); every other B is a whole backward and costs 2 units, as in
        # engine.schedule's analysis
        self.whole = (
            None if split_only is None
            else tuple(frozenset(range(chunks)) - mbs for mbs in split_only)
        )
        self.chunks = chunks
        self.pairs: dict[tuple[int, int, int], tuple[int, int, int]] | None = None
        self.period = 1
        self.reset()

    def overlap(self, overlaps: Any, period: int) -> None:
        """Replay the program's overlapped pairs (``Schedule.overlaps``: (stage, action,
        stage, action)) as engine.schedule's simulator does: a pair starts when both halves
        can. ``period``: the program's micro-batches (its actions repeat after them)."""
        code = {"FORWARD": _F, "BACKWARD": _B, "WEIGHT": _W}
        self.pairs = {
            (sa, code[a.kind.name], a.mb % period): (sb, code[b.kind.name], b.mb % period)
            for sa, a, sb, b in overlaps
        } or None
        self.period = period
        self.reset()

    def reset(self) -> None:
        # a preallocated log: appending to a growing list would take new memory (and a page
        # fault now and then) in steady state
        self._log: list[tuple[int, int, int, float] | None] = [None] * _BATCH
        self._k = 0
        self._replayed = _Replay(
            self.num_stages, self.split, self.ranks, self.whole, self.chunks, self.pairs, self.period
        )

    def record(self, stage: int, op: int, n: int, seconds: float) -> None:
        self._log[self._k] = (stage, op, n, seconds)
        self._k += 1
        if self._k == _BATCH:
            self._replay()

    def _replay(self) -> None:
        self._replayed.run(self._log, self._k)
        self._k = 0

    def barrier(self) -> None:
        """A flush: later actions start after everything so far."""
        self._replay()
        r = self._replayed
        r.flush_held()
        r.barrier_u, r.barrier_w = r.end_u, r.end_w

    def bubble(self) -> tuple[float, float]:
        """(unit-cost, wall-time) bubble fractions of everything recorded since the reset."""
        self._replay()
        return self._replayed.bubbles()
