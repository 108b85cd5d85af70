"""A global-clock simulation of a schedule: when each action starts and ends, or where it deadlocks.

Why simulate rather than reason per schedule: deadlock freedom, bubble fraction and the
global placement all follow from the same as-soon-as-possible execution of the per-stage
lists, and a single simulator keeps the validator, the analysis and the renderer consistent
(the idea follows ``torch.distributed.pipelining``'s ``_simulate_comms_compute``, but with a
cost model and exact start/end times instead of unit steps).

Model: every stage runs its actions strictly in order, one at a time. An action starts when
the previous action of its stage has ended and its cross-stage dependency has ended:

* ``RF(n)`` on s waits for ``SF(n)`` on s-1; ``RB(n)`` on s waits for ``SB(n)`` on s+1
  (sends never block: they are buffered ``isend``\\ s).
* In a schedule without communication actions, ``F(n)`` on s waits for ``F(n)`` on s-1 and
  ``B(n)`` on s waits for ``B(n)`` on s+1.

Same-stage dependencies (F before B, a receive before the compute that uses it) are checked
statically by the validator, not here. If no stage can proceed the schedule deadlocks and a
:class:`ScheduleError` names every blocked action and what it waits for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.schedule.errors import ScheduleError
from engine.schedule.ir import Action, Kind, Schedule

CostValue = float | Sequence[float]


@dataclass(frozen=True)
class Costs:
    """Duration of each kind of action, a number or one number per stage.

    Defaults: F = 1, B = 2 (backward costs about twice a forward), updates and
    communication free. ``backward`` is the cost of a whole backward: a ``B`` split from its
    ``W`` (zero-bubble schedules) costs ``backward - weight`` and the ``W`` costs ``weight``
    (None: half of ``backward``), so splitting never changes a stage's total work.
    """

    forward: CostValue = 1.0
    backward: CostValue = 2.0
    update: CostValue = 0.0
    comm: CostValue = 0.0
    weight: CostValue | None = None

    def of(self, kind: Kind, stage: int, split: bool = False) -> float:
        """Duration of a ``kind`` action on ``stage``; ``split``: a B whose W runs apart."""
        if kind is Kind.WEIGHT or (kind is Kind.BACKWARD and split):
            full = self._value(self.backward, stage)
            w = full / 2 if self.weight is None else self._value(self.weight, stage)
            return w if kind is Kind.WEIGHT else full - w
        value = {
            Kind.FORWARD: self.forward,
            Kind.BACKWARD: self.backward,
            Kind.UPDATE: self.update,
        }.get(kind, self.comm)
        return self._value(value, stage)

    @staticmethod
    def _value(value: CostValue, stage: int) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return float(value[stage])
        except IndexError:
            raise ValueError(
                f"per-stage cost list {list(value)} has no entry for stage {stage}; give one "
                f"cost per stage"
            ) from None

    def check(self, stages: int) -> None:
        for name in ("forward", "backward", "update", "comm", "weight"):
            value = getattr(self, name)
            if value is None:
                continue
            values = [value] if isinstance(value, (int, float)) else list(value)
            if not isinstance(value, (int, float)) and len(values) != stages:
                raise ValueError(
                    f"costs.{name} lists {len(values)} per-stage costs for {stages} stages"
                )
            if any(v < 0 for v in values):
                raise ValueError(f"costs.{name} must be >= 0, got {value}")
        if self.weight is not None:
            for st in range(stages):
                if self.of(Kind.WEIGHT, st) > self._value(self.backward, st):
                    raise ValueError(
                        f"costs.weight ({self.of(Kind.WEIGHT, st)}) exceeds costs.backward "
                        f"({self._value(self.backward, st)}) at stage {st}: the weight "
                        "gradient is part of the whole backward"
                    )


UNIT_COSTS = Costs(forward=1.0, backward=1.0, update=0.0, comm=0.0)
#: one tick for each of F, input-gradient B and W (the ticks of a split-backward schedule)
UNIT_SPLIT_COSTS = Costs(forward=1.0, backward=2.0, update=0.0, comm=0.0, weight=1.0)


@dataclass(frozen=True)
class Timeline:
    """Start and end time of every action (``start[s][i]`` for ``actions[s][i]``)."""

    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]

    @property
    def makespan(self) -> float:
        return max((e[-1] for e in self.end if e), default=0.0)


def _index(schedule: Schedule) -> list[dict[tuple[Kind, int], int]]:
    maps: list[dict[tuple[Kind, int], int]] = []
    for acts in schedule.actions:
        m: dict[tuple[Kind, int], int] = {}
        for i, a in enumerate(acts):
            if a.kind is not Kind.UPDATE:
                m.setdefault((a.kind, a.mb), i)
        maps.append(m)
    return maps


def remote_dependency(
    schedule: Schedule, stage: int, action: Action, has_comms: bool
) -> tuple[int, Action] | None:
    """The (stage, action) on another stage that ``action`` waits for, or None."""
    S = schedule.stages
    k = action.kind
    if k is Kind.RECV_ACT:
        return stage - 1, Action.send_act(action.mb)
    if k is Kind.RECV_GRAD:
        return stage + 1, Action.send_grad(action.mb)
    if not has_comms:
        if k is Kind.FORWARD and stage > 0:
            return stage - 1, Action.forward(action.mb)
        if k is Kind.BACKWARD and stage < S - 1:
            return stage + 1, Action.backward(action.mb)
    return None


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Run ``schedule`` on a global clock (as soon as possible) and return every action's times.

    Raises :class:`ScheduleError` on deadlock, naming each blocked action and what it waits for.
    """
    costs = costs or Costs()
    costs.check(schedule.stages)
    S = schedule.stages
    acts = schedule.actions
    comms = schedule.has_comms
    where = _index(schedule)
    start: list[list[float]] = [[0.0] * len(a) for a in acts]
    end: list[list[float]] = [[0.0] * len(a) for a in acts]
    done: list[list[bool]] = [[False] * len(a) for a in acts]
    # a lane runs its actions one at a time: a stage, or a rank of virtual stages
    lanes = [schedule.rank_sequence(r) for r in range(schedule.ranks)]
    pos = [0] * len(lanes)
    free = [0.0] * len(lanes)
    deps: list[list[tuple[int, int] | None | str]] = []
    for s in range(S):
        row: list[tuple[int, int] | None | str] = []
        for a in acts[s]:
            dep = remote_dependency(schedule, s, a, comms)
            if dep is None:
                row.append(None)
            else:
                r, da = dep
                if not 0 <= r < S or (da.kind, da.mb) not in where[r]:
                    row.append("missing")
                else:
                    row.append((r, where[r][(da.kind, da.mb)]))
        deps.append(row)

    # an overlapped pair starts when both halves can: the first waits for the second's input
    partner: dict[tuple[int, int], tuple[int, int]] = {}
    if schedule.overlaps:
        index = [{a: i for i, a in enumerate(stage)} for stage in acts]
        for sa, a, sb, b in schedule.overlaps:
            partner[(sa, index[sa][a])] = (sb, index[sb][b])

    while True:
        progress = False
        for lane, seq in enumerate(lanes):
            while pos[lane] < len(seq):
                s, i = seq[pos[lane]]
                ready = 0.0
                blocked = False
                for ds, di in ((s, i), partner.get((s, i), (s, i))):
                    dep = deps[ds][di]
                    if dep == "missing":
                        blocked = True
                    elif isinstance(dep, tuple):
                        r, j = dep
                        if not done[r][j]:
                            blocked = True
                        else:
                            ready = max(ready, end[r][j])
                if blocked:
                    break
                t0 = max(free[lane], ready)
                a = acts[s][i]
                split = a.kind is Kind.BACKWARD and (Kind.WEIGHT, a.mb) in where[s]
                t1 = t0 + costs.of(a.kind, s, split)
                start[s][i], end[s][i] = t0, t1
                done[s][i] = True
                free[lane] = t1
                pos[lane] += 1
                progress = True
        if all(p == len(seq) for p, seq in zip(pos, lanes, strict=True)):
            break
        if not progress:
            _raise_deadlock(schedule, lanes, pos, deps, comms)
    return Timeline(tuple(map(tuple, start)), tuple(map(tuple, end)))


def _raise_deadlock(
    schedule: Schedule,
    lanes: list[list[tuple[int, int]]],
    pos: list[int],
    deps: list[list[tuple[int, int] | None | str]],
    comms: bool,
) -> None:
    parts: list[str] = []
    first: tuple[int, int, Action] | None = None
    where = "rank" if schedule.rank_order is not None else "stage"
    for lane, seq in enumerate(lanes):
        if pos[lane] == len(seq):
            continue
        s, i = seq[pos[lane]]
        a = schedule.actions[s][i]
        dep = remote_dependency(schedule, s, a, comms)
        assert dep is not None
        r, da = dep
        d = deps[s][i]
        if d == "missing":
            why = (
                f"which stage {r} never runs"
                if 0 <= r < schedule.stages
                else "from a stage that does not exist"
            )
        else:
            assert isinstance(d, tuple)
            other = schedule.rank_of(r)
            op = pos[other]
            if op < len(lanes[other]):
                rs, ri = lanes[other][op]
                rb = f"{schedule.actions[rs][ri]}" + (f" of stage {rs}" if rs != r else "")
            else:
                rb = "None"
            why = (
                f"(stage {r}'s action {d[1]}), but {where} {other} is stuck at its action "
                f"{op} ({rb})"
            )
        lead = f"stage {s}" if where == "stage" else f"rank {lane} (stage {s})"
        parts.append(f"{lead} action {i} ({a}) waits for {da} on stage {r} {why}")
        if first is None:
            first = (s, i, a)
    assert first is not None
    raise ScheduleError(
        "deadlock, no stage can make progress: "
        + "; ".join(parts)
        + ". Reorder the actions so every receive's matching send can run first.",
        stage=first[0],
        index=first[1],
        action=first[2],
    )


def unit_ticks(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Ticks from an as-soon-as-possible run where F and B (and W) take one tick each.

    Sends and updates share the tick of the compute before them, receives that of the
    compute after them, so a column of the text form reads like a pipeline diagram.
    """
    split = any(a.kind is Kind.WEIGHT for acts in schedule.actions for a in acts)
    tl = simulate(schedule, UNIT_SPLIT_COSTS if split else UNIT_COSTS)
    start = [list(st) for st in tl.start]
    if schedule.overlaps:  # an overlapped pair is issued at once: one tick (one CSV cell)
        index = [{a: i for i, a in enumerate(acts)} for acts in schedule.actions]
        for sa, a, sb, b in schedule.overlaps:
            start[sb][index[sb][b]] = start[sa][index[sa][a]]
    out: list[tuple[int, ...]] = []
    for acts, starts in zip(schedule.actions, start, strict=True):
        compute = [i for i, a in enumerate(acts) if a.kind.is_compute]
        ticks: list[int] = []
        for i, a in enumerate(acts):
            if a.kind.is_compute:
                ticks.append(int(starts[i]))
                continue
            before = [j for j in compute if j < i]
            after = [j for j in compute if j > i]
            if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                ref = after[0] if after else before[-1]
            else:
                ref = before[-1] if before else after[0]
            ticks.append(int(starts[ref]))
        out.append(tuple(ticks))
    return tuple(out)
