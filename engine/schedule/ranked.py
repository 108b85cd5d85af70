"""Schedules written rank by rank: each rank's compute order, placed stages, overlapped pairs.

Why a builder of its own: V-shaped schedules (ZB-V, DualPipeV), looped BFS and every CSV that
torch.distributed.pipelining reads are stated per *rank* -- "rank 1 runs 1F0, 2F0, 1F1, ..."
-- while the IR keeps one action list per stage plus each rank's order. :func:`build` turns
per-rank compute units into a complete program: an update per stage after the unit that
completes its gradients (what TDP calls REDUCE_GRAD), the sends and receives around every unit
(:func:`engine.schedule.lower.add_comms`), and unit-cost ticks in which an overlapped pair
shares one tick (one CSV cell).

A *unit* is a tuple of ``(stage, Action)``: one compute action, or two for an overlapped pair
(a forward and a backward the rank issues together, DualPipeV's ``OVERLAP_F_B``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from engine.schedule.ir import Action, Kind, Schedule
from engine.schedule.lower import add_comms
from engine.schedule.simulate import unit_ticks as simulate_unit_ticks

__all__ = ["Unit", "build", "v_placement", "loop_placement", "unit_ticks"]

Unit = tuple[tuple[int, Action], ...]


def v_placement(ranks: int) -> tuple[tuple[int, ...], ...]:
    """The V: rank r holds stages r and 2R-1-r (the last stage is back on rank 0)."""
    return tuple((r, 2 * ranks - 1 - r) for r in range(ranks))


def loop_placement(ranks: int, stages: int) -> tuple[tuple[int, ...], ...]:
    """Round-robin: rank r holds r, r+R, r+2R, ..."""
    return tuple(tuple(range(r, stages, ranks)) for r in range(ranks))


def _with_updates(units: Sequence[Unit], chunks: int) -> list[Unit]:
    """``units`` with an update ``U0..M-1`` after the unit that completes a stage's last
    gradient (its last W, or its last whole B)."""
    split = {(s, a.mb) for u in units for s, a in u if a.kind is Kind.WEIGHT}
    left: dict[int, int] = {}
    for u in units:
        for s, a in u:
            if a.kind is Kind.FORWARD:
                left[s] = left.get(s, 0) + 1
    out: list[Unit] = []
    for unit in units:
        out.append(unit)
        for s, a in unit:
            whole = a.kind is Kind.BACKWARD and (s, a.mb) not in split
            if a.kind is Kind.WEIGHT or whole:
                left[s] = left.get(s, 0) - 1  # a B without its F: the validator says so
                if left[s] == 0:
                    out.append(((s, Action.update(range(chunks))),))
    return out


def build(
    name: str,
    placement: Sequence[Sequence[int]],
    chunks: int,
    units: Sequence[Sequence[Unit]],
    *,
    steps: int = 1,
    order: str | None = None,
    with_updates: bool = True,
    ticks: bool = True,
) -> Schedule:
    """A synchronous program from each rank's compute units of one mini-batch (micro-batches
    0..M-1), repeated for ``steps`` mini-batches; ``with_updates`` adds each stage's update
    (k = M) after the unit completing its gradients. The result has communication actions
    and, with ``ticks``, the unit-cost clock. Not validated here (callers validate)."""
    R = len(placement)
    S = sum(len(p) for p in placement)
    place = tuple(tuple(p) for p in placement)
    v = len(place[0])
    M = chunks
    actions: list[list[Action]] = [[] for _ in range(S)]
    rank_order: list[list[int]] = [[] for _ in range(R)]
    overlaps: list[tuple[int, Action, int, Action]] = []
    for t in range(steps):
        base = t * M
        for r in range(R):
            rank_units = list(units[r])
            if with_updates:
                rank_units = _with_updates(rank_units, M)
            for unit in rank_units:
                moved = []
                for s, a in unit:
                    if a.kind is Kind.UPDATE:
                        a = Action.update(m + base for m in a.mbs)
                    else:
                        a = Action(a.kind, (a.mb + base,))
                    actions[s].append(a)
                    rank_order[r].append(s)
                    moved.append((s, a))
                if len(moved) == 2:
                    (sa, a), (sb, b) = moved
                    overlaps.append((sa, a, sb, b))
    round_robin = place == loop_placement(R, S)
    if v == 1:  # one stage per rank: plain per-stage lists (rank r holds stage r)
        if not round_robin:
            raise ValueError(
                f"with one stage per rank, rank r must hold stage r; got placement "
                f"{[list(p) for p in place]}"
            )
        if overlaps:
            raise ValueError("an overlapped pair needs two stages on one rank")
    program = Schedule(
        name=name,
        stages=S,
        chunks=M,
        steps=steps,
        update_size=M,
        order=order or name,
        weights="live",
        actions=tuple(map(tuple, actions)),
        virtual_stages=v,
        rank_order=tuple(map(tuple, rank_order)) if v > 1 else None,
        placement=None if round_robin else place,
        overlaps=tuple(overlaps),
    )
    program = add_comms(program)
    return replace(program, ticks=unit_ticks(program)) if ticks else program


def unit_ticks(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """The generators' unit-cost ticks (an overlapped pair shares the tick of its start)."""
    return simulate_unit_ticks(schedule)
