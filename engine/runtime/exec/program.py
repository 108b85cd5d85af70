"""Step programs: a schedule's per-stage action streams, cut at ``step()`` boundaries, once.

Why compile: a pipeline step runs the same pattern of actions over and over (a synchronous
schedule repeats its mini-batch; an asynchronous one reaches a periodic steady state after
its fill). Re-deriving the per-stage streams, the cross-stage order and the communication
bookkeeping on every step cost more than the work on a small model. Here each distinct step
is compiled once into a :class:`StepProgram` with micro-batch ids *relative* to the step's
first micro-batch, detected to repeat (a period of P = k / gcd(M, k) steps for the built-in
families), and reused; :attr:`StepCompiler.compiled` counts compilations (tests assert it
stops growing).

What a step contains. Stage s runs its stream until the forward (the receive, on s > 0) of
a micro-batch that has not been fed yet; every rank stops at the same point of its stream,
so under a blocking transport no receive waits for a message the current call will not
produce. A *drain* (``flush()``) runs what is left for the fed micro-batches: actions on
later micro-batches are dropped and an update applies the pending gradients that arrived (a
partial group). A finite program (a user's Schedule) runs its last step to the end and then
starts over.

Two executable forms per step:

* ``local``: every stage in this process. The stages' lists are merged into one order by a
  list-scheduling simulation (forward 1, backward 2, everything else free, earliest start
  first): a valid order (each receive after its send) that also enqueues work in wavefront
  order, so per-stage CUDA streams overlap. Sends and receives become in-process hand-offs
  and disappear; synchronous programs keep their updates apart (``commit``) so the loss
  check and the all-or-nothing update phase run after every backward.
* ``stages[s]``: one stage's list with its communication, for one process per stage, with
  the bookkeeping the blocking transport needs precomputed (which sent gradients a received
  activation proves consumed, how many receives are certain to come in this call).

Model (programs do not depend on tensor shapes, so (spec) is the whole cache key).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.errors import ScheduleError
from engine.schedule.ir import Action, Kind
from engine.schedule.spec import ScheduleSpec
from engine.schedule.streams import stage_actions

__all__ = [
    "F", "B", "U", "SF", "RF", "SB", "RB", "BB", "W", "OP_NAMES", "StepProgram", "StepCompiler"
]

# op codes (ints: the executor dispatches on them per action); BB: a batch of independent
# backwards of different stages run by one autograd call (in-process programs only); W: the
# weight gradient of a backward split into B (input gradient) and W (zero-bubble schedules)
F, B, U, SF, RF, SB, RB, BB, W = range(9)
OP_NAMES = ("F", "B", "U", "SF", "RF", "SB", "RB", "BB", "W")
_OP = {
    Kind.FORWARD: F,
    Kind.BACKWARD: B,
    Kind.WEIGHT: W,
    Kind.UPDATE: U,
    Kind.SEND_ACT: SF,
    Kind.RECV_ACT: RF,
    Kind.SEND_GRAD: SB,
    Kind.RECV_GRAD: RB,
}
_COST = {F: 1.0, B: 2.0, W: 1.0}

#: one action with a relative micro-batch: (op, mb) or (U, (mb, ...))
Op = tuple[int, Any]


@dataclass(frozen=True, eq=False)
class StepProgram:
    """One compiled step (or drain). Micro-batch ids are relative to ``base``'s step: the
    executor adds the step's first segment micro-batch id.

    ``stages[s]``: stage s's ops, communication included. ``local``: (op, stage, mb) in a
    valid cross-stage order without communication (updates excluded when ``commit`` holds
    them). ``commit``: (stage, mbs) updates of a synchronous step, applied after the loss
    check. ``releases[s]``: op index of a receive ``RF m`` -> gradients stage s-1 consumed
    before sending m. ``certain[s]``: op index of a receive -> (relative) micro-batches
    below which every receive on that channel happens in this call. ``ends_segment``: after
    this step the streams start over (a drain, or a finite program's last step).
    """

    kind: str
    index: int
    stages: tuple[tuple[Op, ...], ...]
    local: tuple[tuple[int, int, Any], ...]
    commit: tuple[tuple[int, tuple[int, ...]], ...]
    releases: tuple[dict[int, tuple[int, ...]], ...]
    certain: tuple[dict[int, int], ...]
    ends_segment: bool
    unit_makespan: float = 0.0
    fed: int = field(default=0)  # micro-batches fed when it runs, relative to base
    #: per lane (a stage; with virtual stages a rank): its (stage, index in ``stages[stage]``)
    #: in the order one process runs them (engine/runtime/ranks/rank.py)
    lanes: tuple[tuple[tuple[int, int], ...], ...] = ()

    def __repr__(self) -> str:
        n = sum(len(s) for s in self.stages)
        return f"StepProgram({self.kind} {self.index}, {n} actions, ends_segment={self.ends_segment})"


_END = None


def _rounds(
    spec: ScheduleSpec, acts: list[list[Action]], sent_before: set[tuple[int, int, int]]
) -> list[tuple[int, int, Any]]:
    """A valid cross-stage order of an asynchronous step's compute and update actions, in
    rounds: every stage runs as far as it can up to its next backward, then every stage whose
    next action is a backward runs it, all of them in ONE autograd call (a ``BB`` op).

    Why rounds: every autograd call has a fixed cost (more than a small stage's whole
    backward, docs/design-notes.md), and in an asynchronous steady state
    every stage runs a backward per tick. Backwards that are ready at the same time belong to
    different stages and do not feed each other (B(s, m) needs B(s+1, m)'s gradient, which
    comes through a receive that already returned), so one call over their independent graphs,
    with disjoint parameters, computes exactly what the separate calls compute."""
    S = spec.stages
    pos = [0] * S
    sent = set(sent_before)
    out: list[tuple[int, int, Any]] = []
    base = 0
    total = sum(len(a) for a in acts)
    done = 0
    while done < total:
        progressed = False
        for s in range(S):
            row = acts[s]
            while pos[s] < len(row):
                a = row[pos[s]]
                k = a.kind
                if k is Kind.BACKWARD:
                    break
                if k is Kind.RECV_ACT and (SF, s - 1, a.mb) not in sent:
                    break
                if k is Kind.RECV_GRAD and (SB, s + 1, a.mb) not in sent:
                    break
                if k is Kind.SEND_ACT:
                    sent.add((SF, s, a.mb))
                elif k is Kind.SEND_GRAD:
                    sent.add((SB, s, a.mb))
                elif k is Kind.FORWARD:
                    out.append((F, s, a.mb - base))
                elif k is Kind.WEIGHT:
                    out.append((W, s, a.mb - base))
                elif k is Kind.UPDATE:
                    out.append((U, s, tuple(m - base for m in a.mbs)))
                pos[s] += 1
                done += 1
                progressed = True
        ready = [s for s in range(S) if pos[s] < len(acts[s]) and acts[s][pos[s]].kind is Kind.BACKWARD]
        if ready:
            items = tuple((s, acts[s][pos[s]].mb - base) for s in ready)
            if len(items) == 1 or spec.split_backward:  # a split B runs on its own (Stage.split)
                out.extend((B, s, m) for s, m in items)
            else:
                out.append((BB, -1, items))
            for s in ready:
                pos[s] += 1
            done += len(ready)
            progressed = True
        if not progressed:
            raise _stuck(spec, acts, pos)
    return out


def _stuck(spec: ScheduleSpec, acts: list[list[Action]], pos: list[int]) -> ScheduleError:
    """The error for a step in which no stage can proceed."""
    stuck = "; ".join(
        f"stage {s} waits at {acts[s][pos[s]]}" for s in range(len(acts)) if pos[s] < len(acts[s])
    )
    return ScheduleError(
        f"{spec.describe()} cannot run step by step: within one step no stage can proceed "
        f"({stuck}); each step must be able to finish on the micro-batches fed so far"
    )


class _Walker:
    """Walks every stage's stream step by step (the state a sequence of steps leaves)."""

    def __init__(self, spec: ScheduleSpec) -> None:
        self.spec = spec
        S = spec.stages
        self.its: list[Iterator[Action]] = [self._source(s) for s in range(S)]
        self.ahead: list[Action | None] = [self._pull(s) for s in range(S)]
        self.j = 0  # steps walked
        self.backwards = [0] * S
        self.pending: list[set[int]] = [set() for _ in range(S)]
        self.sent: set[tuple[int, int, int]] = set()  # (op, stage, mb) sends done
        self._since_sf: list[list[int]] = [[] for _ in range(S)]
        self._released: dict[tuple[int, int], tuple[int, ...]] = {}  # (stage, m) -> grads

    def _source(self, s: int) -> Iterator[Action]:
        spec = self.spec
        if spec.program is not None:
            return iter(spec.program.actions[s])
        return stage_actions(
            spec.name, s, spec.stages, spec.chunks, spec.update_size, spec.order
        )

    def _pull(self, s: int) -> Action | None:
        return next(self.its[s], _END)

    def _take(self, s: int) -> Action:
        a = self.ahead[s]
        assert a is not None
        self.ahead[s] = self._pull(s)
        if a.kind is Kind.BACKWARD:
            self.backwards[s] += 1
            self.pending[s].add(a.mb)
            self._since_sf[s].append(a.mb)
        elif a.kind is Kind.UPDATE:
            self.pending[s].difference_update(a.mbs)
        elif a.kind is Kind.SEND_ACT:
            self._released[(s + 1, a.mb)] = tuple(self._since_sf[s])
            self._since_sf[s] = []
            self.sent.add((SF, s, a.mb))
        elif a.kind is Kind.SEND_GRAD:
            self.sent.add((SB, s, a.mb))
        return a

    @property
    def finite_last(self) -> bool:
        p = self.spec.program
        return p is not None and self.j == p.steps - 1

    def step(self) -> list[list[Action]]:
        """Every stage's actions of the next step (absolute micro-batch ids)."""
        fed = (self.j + 1) * self.spec.chunks
        to_end = self.finite_last
        out: list[list[Action]] = []
        for s in range(self.spec.stages):
            acts: list[Action] = []
            while True:
                a = self.ahead[s]
                if a is None:
                    break
                if not to_end and a.kind in (Kind.FORWARD, Kind.RECV_ACT) and a.mb >= fed:
                    break
                acts.append(self._take(s))
            out.append(acts)
        self.j += 1
        return out

    def drain(self) -> list[list[Action]]:
        """Every stage's remaining actions on the fed micro-batches, partial updates included."""
        fed = self.j * self.spec.chunks
        out: list[list[Action]] = []
        for s in range(self.spec.stages):
            acts: list[Action] = []
            while not (self.backwards[s] >= fed and not self.pending[s]):
                a = self.ahead[s]
                if a is None:
                    break
                self._take(s)
                if a.kind is Kind.UPDATE:
                    keep = [m for m in a.mbs if m < fed]
                    if keep:
                        acts.append(Action.update(keep))
                elif a.mb < fed:
                    acts.append(a)
            while self.ahead[s] is not None and self.ahead[s].kind in (  # type: ignore[union-attr]
                Kind.SEND_GRAD,
                Kind.SEND_ACT,
            ) and self.ahead[s].mb < fed:  # type: ignore[union-attr]
                acts.append(self._take(s))
            out.append(acts)
        return out

    def released(self, stage: int, m: int) -> tuple[int, ...]:
        return self._released.pop((stage, m), ())


def _rel(a: Action, base: int) -> Op:
    op = _OP[a.kind]
    if op == U:
        return (U, tuple(m - base for m in a.mbs))
    return (op, a.mb - base)


def _lanes(spec: ScheduleSpec, acts: list[list[Action]]) -> list[list[tuple[int, int]]]:
    """The (stage, index in ``acts[stage]``) sequences that run one action at a time: every
    stage on its own, or with virtual stages each rank in its ``rank_order`` (restricted to
    this step's actions; an action occurs once per stage, so it is found by value)."""
    program = spec.program
    if program is None or program.rank_order is None:
        return [[(s, i) for i in range(len(a))] for s, a in enumerate(acts)]
    here = [{a: i for i, a in enumerate(stage_acts)} for stage_acts in acts]
    lanes: list[list[tuple[int, int]]] = []
    for r in range(program.ranks):
        lane = []
        for vs, i in program.rank_sequence(r):
            j = here[vs].get(program.actions[vs][i])
            if j is not None:
                lane.append((vs, j))
        lanes.append(lane)
    return lanes


def _merge(
    spec: ScheduleSpec, acts: list[list[Action]], sent_before: set[tuple[int, int, int]]
) -> tuple[list[tuple[int, int, Action]], float, list[list[tuple[int, int]]]]:
    """A valid cross-stage order of one step's actions (list scheduling, earliest start first)
    and the step's makespan under unit costs (F = 1, B = 2). Raises ScheduleError when the
    step cannot finish on its own (a receive whose send comes in a later step). With virtual
    stages a rank runs its stages' actions one at a time, in its order."""
    lanes = _lanes(spec, acts)
    pos = [0] * len(lanes)
    free = [0.0] * len(lanes)
    sent_now: dict[tuple[int, int, int], float] = {}
    order: list[tuple[int, int, Action]] = []
    total = sum(len(a) for a in acts)
    while len(order) < total:
        best: tuple[float, int] | None = None
        for r, lane in enumerate(lanes):
            if pos[r] >= len(lane):
                continue
            s, i = lane[pos[r]]
            a = acts[s][i]
            ready = 0.0
            if a.kind is Kind.RECV_ACT or a.kind is Kind.RECV_GRAD:
                peer = s - 1 if a.kind is Kind.RECV_ACT else s + 1
                key = (SF if a.kind is Kind.RECV_ACT else SB, peer, a.mb)
                if key in sent_now:
                    ready = sent_now[key]
                elif key not in sent_before:
                    continue
            start = max(free[r], ready)
            if best is None or (start, r) < best:
                best = (start, r)
        if best is None:
            raise _stuck(spec, acts, _positions(acts, order))
        start, r = best
        s, i = lanes[r][pos[r]]
        a = acts[s][i]
        op = _OP[a.kind]
        end = start + _COST.get(op, 0.0)
        free[r] = end
        if op == SF or op == SB:
            sent_now[(op, s, a.mb)] = end
        order.append((s, i, a))
        pos[r] += 1
    return order, max(free, default=0.0), lanes


def _positions(acts: list[list[Action]], order: list[tuple[int, int, Action]]) -> list[int]:
    """Per stage, how many of its actions are ordered (they are ordered as a prefix)."""
    pos = [0] * len(acts)
    for s, _i, _a in order:
        pos[s] += 1
    return pos


class StepCompiler:
    """Compiles and caches the step programs of one :class:`ScheduleSpec` (module docs)."""

    def __init__(self, spec: ScheduleSpec) -> None:
        self.spec = spec
        self.compiled = 0
        self._walker = _Walker(spec)
        self._steps: list[StepProgram] = []
        self._period: tuple[int, int] | None = None  # (first periodic step j0, period P)
        self._drains: dict[int, StepProgram] = {}
        M, k = spec.chunks, spec.update_size
        self._P = k // math.gcd(M, k)
        # the fill lasts at most 2(S-1) micro-batches (dataflow) plus an update group: the
        # period is looked for only after it, where the built-in streams repeat exactly
        # (synchronous families repeat their mini-batch from the first step)
        self._settle = 0 if spec.synchronous else (2 * (spec.stages - 1) + 2 * k) // M + 2
        if spec.program is not None:
            self._steps_limit: int | None = spec.program.steps
        else:
            self._steps_limit = None

    # ------------------------------------------------------------------ lookup

    def step(self, j: int) -> StepProgram:
        """The program of segment step ``j`` (0-based)."""
        if self._steps_limit is not None and j >= self._steps_limit:
            raise IndexError(f"the program has {self._steps_limit} steps; step {j} does not exist")
        if self._period is not None and j >= self._period[0]:
            j0, P = self._period
            return self._steps[j0 + (j - j0) % P]
        while len(self._steps) <= j:
            self._compile_next()
            if self._period is not None and j >= self._period[0]:
                return self.step(j)
        return self._steps[j]

    def drain(self, j: int) -> StepProgram:
        """The drain after ``j`` steps of a segment (``flush()``)."""
        key = self._drain_key(j)
        prog = self._drains.get(key)
        if prog is None:
            walker = _Walker(self.spec)
            for _ in range(key):
                walker.step()
            acts = walker.drain()
            prog = self._build("drain", key, walker, acts, key * self.spec.chunks, ends=True)
            self._drains[key] = prog
        return prog

    def _drain_key(self, j: int) -> int:
        if self._period is None:
            self.step(j)  # compile up to j (may discover the period)
        if self._period is not None:
            j0, P = self._period
            if j >= j0 + P:
                return j0 + P + (j - j0 - P) % P
        return j

    # ------------------------------------------------------------------ compiling

    def _compile_next(self) -> None:
        w = self._walker
        j = w.j
        to_end = w.finite_last
        acts = w.step()
        prog = self._build("step", j, w, acts, j * self.spec.chunks, ends=to_end)
        self._steps.append(prog)
        if self._steps_limit is None and self._period is None:
            P = self._P
            n = len(self._steps)
            if n >= 2 * P + self._settle and all(
                self._steps[n - P + i].stages == self._steps[n - 2 * P + i].stages
                for i in range(P)
            ):
                self._period = (n - 2 * P, P)
                del self._steps[n - P :]
            elif n > 4 * (self.spec.stages + self.spec.update_size + P) + 8:
                raise RuntimeError(
                    f"{self.spec.describe()}: its steps did not become periodic after {n} "
                    "steps; this is a bug in the schedule's stream generator"
                )

    def _build(
        self,
        kind: str,
        index: int,
        walker: _Walker,
        acts: list[list[Action]],
        base: int,
        *,
        ends: bool,
    ) -> StepProgram:
        spec = self.spec
        S = spec.stages
        this_step = {
            (_OP[a.kind], s, a.mb)
            for s, stage_acts in enumerate(acts)
            for a in stage_acts
            if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD)
        }
        order, makespan, lanes = _merge(spec, acts, walker.sent - this_step)
        stages = tuple(tuple(_rel(a, base) for a in stage_acts) for stage_acts in acts)
        local: list[tuple[int, int, Any]] = []
        commit: list[tuple[int, tuple[int, ...]]] = []
        for s, _i, a in order:
            op, mb = _rel(a, base)
            if op in (F, B, W):
                local.append((op, s, mb))
            elif op == U:
                if spec.synchronous:
                    commit.append((s, mb))
                else:
                    local.append((op, s, mb))
        releases: list[dict[int, tuple[int, ...]]] = []
        certain: list[dict[int, int]] = []
        fed_rel = spec.chunks if kind == "step" else 0
        for s in range(S):
            rel_ops = stages[s]
            rls: dict[int, tuple[int, ...]] = {}
            crt: dict[int, int] = {}
            last_rb = -(10**9)
            for i in range(len(rel_ops) - 1, -1, -1):
                op, mb = rel_ops[i]
                if op == RB:
                    last_rb = max(last_rb, mb)
                    crt[i] = fed_rel if kind == "drain" else last_rb + 1
                elif op == RF:
                    crt[i] = fed_rel
                    rls[i] = tuple(m - base for m in walker.released(s, mb + base))
            releases.append(rls)
            certain.append(crt)
        self.compiled += 1
        if not spec.synchronous:
            # relative ids: _rounds works on absolute ones, so shift afterwards
            local = [
                (op, st, (m - base) if op in (F, B, W) else tuple((x, y - base) for x, y in m) if op == BB else tuple(v - base for v in m))
                for op, st, m in _rounds(spec, acts, walker.sent - this_step)
            ]
        return StepProgram(
            kind=kind,
            index=index,
            stages=stages,
            local=tuple(local),
            commit=tuple(sorted(commit)),
            releases=tuple(releases),
            certain=tuple(certain),
            ends_segment=ends,
            unit_makespan=makespan,
            fed=fed_rel,
            lanes=tuple(map(tuple, lanes)),
        )
