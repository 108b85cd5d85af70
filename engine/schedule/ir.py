"""The schedule IR: what every stage runs, in order, as plain immutable data.

Why data and not code: one schedule has to drive several consumers that must agree to the
bit -- the single-process runtime (which is also the exact staleness simulator), the
gloo/NCCL runtime, the validator, the analysis that derives each stage's delay D_s, and the
timeline renderer. If the order of work lived inside an executor loop, each of those would
re-derive it and drift. Here a :class:`Schedule` is a list of :class:`Action` per stage;
everything else reads it.

Action kinds (the text token in brackets, see :mod:`engine.schedule.text`):

* ``F`` [``F3``]: forward of micro-batch 3 on this stage.
* ``B`` [``B3``]: backward of micro-batch 3 (input and weight gradient together), or only
  the input gradient when a ``W3`` of the same micro-batch appears on the stage.
* ``W`` [``W3``]: the weight gradient of micro-batch 3, split off its ``B3`` (zero-bubble
  schedules, Qi et al. 2023): it runs after ``B3`` and before the update that applies it.
* ``U`` [``U0-3``, ``U5``, ``U0-1+4``]: one optimizer step on this stage applying the summed
  gradients of exactly the listed micro-batches. The list *is* the update's content, so the
  runtime knows which gradients to coalesce and the validator can check that each gradient
  is applied exactly once. The update size k is the length of the list.
* ``SF``/``RF`` [``SF3``/``RF3``]: send micro-batch 3's activation to stage s+1 / receive it
  from stage s-1.
* ``SB``/``RB`` [``SB3``/``RB3``]: send micro-batch 3's input gradient to stage s-1 /
  receive it from stage s+1.

Communication semantics: sends are asynchronous (``isend``; they never block the sender),
receives block until the matching send has run. On every channel (s -> s+1 activations,
s+1 -> s gradients) sends and receives happen in the same order, so a transport may match
them FIFO. A schedule with no communication actions at all is also accepted (the compact
form ``F0 F1 B0 U0 ...``); its cross-stage dependencies are then implied (F(n) on s needs
F(n) on s-1, B(n) on s needs B(n) on s+1). Generators always emit communication actions.

Weight semantics are carried by ``Schedule.weights`` (a policy name), not by extra actions:

* ``"live"`` (naive, gpipe, 1f1b, pb): F and B use the stage's current weights.
* ``"stash"`` (pipedream): F(n) stashes the weights it read; B(n) uses that stash and frees
  it. The stash and unstash points are exactly the F(n) and B(n) actions, so extra actions
  would only repeat them.
* ``"2bw"``: F(n) and B(n) use version max(floor(n / M) - 1, 0) (n counted from 0, M =
  chunks); the version switch happens at the first forward of each mini-batch.

:func:`engine.schedule.analyze` turns policy + order into per-micro-batch records (``t_F``,
``t_B``, the weight version F and B use, the update that applies the gradient); the runtime
can follow those records directly or re-derive them from the policy, and tests compare the
two.

``Schedule.ticks`` optionally places every action on a global integer clock (one tick per
column of the text form). For ``pb`` in dataflow order it is the tick of Kosson et al. (at
tick t stage s runs F(t-s) and B(t-2(S-1)+s)); for the other generated schedules it is the
slot each action gets when forwards and backwards take one tick each. Rule: ticks never
decrease along a stage, and a dependency on another stage lies in a strictly earlier tick.

Virtual stages (interleaved 1F1B, Narayanan et al. 2021): with ``virtual_stages`` v > 1 the
``stages`` action lists are the S*v *virtual* stages, so every per-stage consumer works
unchanged, and rank r = s % R (R = stages / v ranks) runs virtual stages r, r+R, r+2R, ...
``rank_order[r]`` says in which order rank r runs them: it names, one entry per action, the
virtual stage whose next action runs, so the rank executes its stages' lists merged in that
order, one action at a time. The simulator and the validator execute ranks sequentially in
this order (the deadlock check that matters for one process per rank).

Placement (which rank holds which stages): by default round-robin as above. ``placement``
names the stages of every rank explicitly, e.g. the V of zero-bubble V schedules (rank r holds
r and 2R-1-r, so the last stage is back on rank 0 and the loss is computed where the input
entered) or any other map; every consumer asks :meth:`Schedule.rank_of` / ``rank_stages``.

Overlapped pairs (DualPipeV): ``overlaps`` lists pairs of compute actions of one rank -- a
forward of one stage and a backward of another -- that the rank issues together (torch's
``(0F7;7B3)OVERLAP_F_B``). They are adjacent in the rank's order and run in that order (on
CPU one after the other, which is also what the simulator charges); the pair only records
that a GPU runtime may overlap them, and the CSV writer prints them as one cell.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class Kind(str, enum.Enum):
    """What an action does; the value is its text prefix."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    UPDATE = "U"
    SEND_ACT = "SF"
    RECV_ACT = "RF"
    SEND_GRAD = "SB"
    RECV_GRAD = "RB"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)

    @property
    def is_comm(self) -> bool:
        return self in (Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD)

    @property
    def peer_offset(self) -> int:
        """Stage offset of the peer of a communication action (0 for compute/update)."""
        return {
            Kind.SEND_ACT: +1,
            Kind.RECV_ACT: -1,
            Kind.SEND_GRAD: -1,
            Kind.RECV_GRAD: +1,
        }.get(self, 0)


WEIGHT_POLICIES: tuple[str, ...] = ("live", "stash", "2bw")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one stage.

    ``mbs`` holds the micro-batch index for F/B/send/recv (a 1-tuple) and the micro-batches
    whose gradients an update applies (any length >= 1, sorted, distinct) for U.
    """

    kind: Kind
    mbs: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", Kind(self.kind))
        mbs = tuple(int(m) for m in self.mbs)
        object.__setattr__(self, "mbs", mbs)
        if not mbs:
            raise ValueError(f"{self.kind.value} action needs at least one micro-batch index")
        if any(m < 0 for m in mbs):
            raise ValueError(f"micro-batch indices must be >= 0, got {mbs} in a {self.kind.value}")
        if self.kind is Kind.UPDATE:
            if list(mbs) != sorted(set(mbs)):
                raise ValueError(
                    f"an update's micro-batches must be distinct and sorted, got {mbs}; "
                    f"write e.g. Action.update({sorted(set(mbs))})"
                )
        elif len(mbs) != 1:
            raise ValueError(
                f"a {self.kind.value} action concerns exactly one micro-batch, got {mbs}"
            )

    # constructors -------------------------------------------------------------------
    @classmethod
    def forward(cls, mb: int) -> Action:
        return cls(Kind.FORWARD, (mb,))

    @classmethod
    def backward(cls, mb: int) -> Action:
        return cls(Kind.BACKWARD, (mb,))

    @classmethod
    def weight(cls, mb: int) -> Action:
        return cls(Kind.WEIGHT, (mb,))

    @classmethod
    def update(cls, mbs: Iterable[int]) -> Action:
        return cls(Kind.UPDATE, tuple(sorted(mbs)))

    @classmethod
    def send_act(cls, mb: int) -> Action:
        return cls(Kind.SEND_ACT, (mb,))

    @classmethod
    def recv_act(cls, mb: int) -> Action:
        return cls(Kind.RECV_ACT, (mb,))

    @classmethod
    def send_grad(cls, mb: int) -> Action:
        return cls(Kind.SEND_GRAD, (mb,))

    @classmethod
    def recv_grad(cls, mb: int) -> Action:
        return cls(Kind.RECV_GRAD, (mb,))

    # accessors ----------------------------------------------------------------------
    @property
    def mb(self) -> int:
        """The micro-batch of a non-update action."""
        if self.kind is Kind.UPDATE:
            raise AttributeError("an update applies several micro-batches; use .mbs")
        return self.mbs[0]

    def __str__(self) -> str:
        return format_action(self)

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"


def _format_mbs(mbs: tuple[int, ...]) -> str:
    runs: list[tuple[int, int]] = []
    for m in mbs:
        if runs and m == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], m)
        else:
            runs.append((m, m))
    return "+".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def format_action(action: Action) -> str:
    """The text token of one action, e.g. ``F3``, ``RB2``, ``U0-3``."""
    if action.kind is Kind.UPDATE:
        return "U" + _format_mbs(action.mbs)
    return f"{action.kind.value}{action.mb}"


Stage = tuple[Action, ...]


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered actions plus the facts needed to interpret them.

    Attributes:
        name: schedule family (one of ``SCHEDULES`` for generated ones; free text otherwise).
        stages: S, the number of pipeline stages.
        chunks: M, micro-batches per mini-batch.
        steps: T, mini-batches covered; micro-batches are numbered 0 .. T*M-1.
        update_size: k, micro-batches per update; every ``U`` applies exactly k (the
            generators require k to divide T*M, so the final drain is a full update).
        order: ``"naive"``, ``"fill-drain"`` (gpipe), ``"1f1b"`` or ``"dataflow"``.
        weights: weight policy, ``"live"``, ``"stash"`` or ``"2bw"`` (see module docs).
        actions: ``actions[s]`` is stage s's ordered tuple of :class:`Action`.
        ticks: ``ticks[s][i]`` is the global tick of ``actions[s][i]``, or None.
    """

    name: str
    stages: int
    chunks: int
    steps: int
    update_size: int
    order: str
    weights: str
    actions: tuple[Stage, ...]
    ticks: tuple[tuple[int, ...], ...] | None = field(default=None)
    #: v: virtual stages per rank (1: one stage per rank, ``rank_order`` None)
    virtual_stages: int = 1
    #: per rank, the virtual stage of each action in the order the rank runs them
    rank_order: tuple[tuple[int, ...], ...] | None = field(default=None)
    #: per rank, the stages it holds (None: round-robin, stage s on rank s % R)
    placement: tuple[tuple[int, ...], ...] | None = field(default=None)
    #: overlapped pairs (stage, action, stage, action), adjacent in their rank's order
    overlaps: tuple[tuple[int, Action, int, Action], ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if self.ticks is not None:
            object.__setattr__(self, "ticks", tuple(tuple(int(t) for t in ts) for ts in self.ticks))
        if self.stages < 1 or self.chunks < 1 or self.steps < 1 or self.update_size < 1:
            raise ValueError(
                f"stages, chunks, steps and update_size must all be >= 1, got S={self.stages}, "
                f"M={self.chunks}, T={self.steps}, k={self.update_size}"
            )
        if self.weights not in WEIGHT_POLICIES:
            raise ValueError(
                f"unknown weight policy {self.weights!r}; use one of {WEIGHT_POLICIES}"
            )
        if len(self.actions) != self.stages:
            raise ValueError(
                f"schedule {self.name!r} declares S={self.stages} stages but has "
                f"{len(self.actions)} action lists; give one list per stage"
            )
        for s, acts in enumerate(self.actions):
            for i, a in enumerate(acts):
                if not isinstance(a, Action):
                    raise TypeError(f"stage {s}, action {i}: expected an Action, got {a!r}")
        if self.ticks is not None:
            if len(self.ticks) != self.stages or any(
                len(t) != len(a) for t, a in zip(self.ticks, self.actions, strict=True)
            ):
                raise ValueError(
                    "ticks must give one tick per action on every stage "
                    "(same shape as actions), or be None"
                )
        self._check_ranks()

    def _check_ranks(self) -> None:
        v = self.virtual_stages
        if self.placement is not None:
            self._check_placement()
        if self.overlaps:
            object.__setattr__(self, "overlaps", tuple(sorted(tuple(p) for p in self.overlaps)))
        if v == 1 and self.rank_order is None:
            if self.overlaps:
                raise ValueError("overlapped pairs need a rank_order (a rank runs several stages)")
            return
        if not isinstance(v, int) or v < 2 or self.stages % v:
            raise ValueError(
                f"virtual_stages={v!r} must be an int >= 2 dividing stages={self.stages} "
                "(or 1 without a rank_order)"
            )
        if self.rank_order is None:
            raise ValueError(f"virtual_stages={v} needs a rank_order (one list per rank)")
        order = tuple(tuple(int(x) for x in r) for r in self.rank_order)
        object.__setattr__(self, "rank_order", order)
        R = self.ranks
        if len(order) != R:
            raise ValueError(f"rank_order has {len(order)} lists for {R} ranks (stages / v)")
        for r, seq in enumerate(order):
            own = self.rank_stages(r)
            for vs in own:
                if seq.count(vs) != len(self.actions[vs]):
                    raise ValueError(
                        f"rank {r}'s order names virtual stage {vs} {seq.count(vs)} times but "
                        f"that stage has {len(self.actions[vs])} actions"
                    )
            foreign = sorted(set(seq) - set(own))
            if foreign:
                where = (
                    f"its placement is {list(own)}" if self.placement is not None
                    else f"rank r runs the stages s with s % {R} == r"
                )
                raise ValueError(
                    f"rank {r}'s order names virtual stages {foreign}, which run on other ranks "
                    f"({where})"
                )
        self._check_overlaps()

    def _check_placement(self) -> None:
        place = tuple(tuple(int(x) for x in r) for r in self.placement)  # type: ignore[union-attr]
        object.__setattr__(self, "placement", place)
        held = sorted(x for r in place for x in r)
        if held != list(range(self.stages)):
            raise ValueError(
                f"placement {[list(r) for r in place]} must put each of the {self.stages} stages "
                "on exactly one rank"
            )
        sizes = {len(r) for r in place}
        if sizes != {self.virtual_stages}:
            raise ValueError(
                f"placement {[list(r) for r in place]} must give every rank virtual_stages="
                f"{self.virtual_stages} stages"
            )

    def _check_overlaps(self) -> None:
        if not self.overlaps:
            return
        pos: dict[tuple[int, Action], tuple[int, int]] = {}
        for r in range(self.ranks):
            for p, (vs, i) in enumerate(self.rank_sequence(r)):
                pos[(vs, self.actions[vs][i])] = (r, p)
        for sa, a, sb, b in self.overlaps:
            pa, pb = pos.get((sa, a)), pos.get((sb, b))
            what = f"overlapped pair ({sa}:{a};{sb}:{b})"
            if pa is None or pb is None:
                raise ValueError(f"{what} names an action its stage does not have")
            if not (a.kind.is_compute and b.kind.is_compute):
                raise ValueError(f"{what}: both halves must be F, B or W")
            if pa[0] != pb[0] or pb[1] != pa[1] + 1:
                raise ValueError(
                    f"{what}: the halves must be adjacent in one rank's order (rank, position "
                    f"{pa} and {pb})"
                )

    @property
    def ranks(self) -> int:
        """R: processes the schedule runs on (``stages`` when there are no virtual stages)."""
        if self.placement is not None:
            return len(self.placement)
        return self.stages // self.virtual_stages

    def rank_stages(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, in increasing order of stage for round-robin placement."""
        if self.placement is not None:
            return self.placement[rank]
        return tuple(range(rank, self.stages, self.ranks))

    def rank_of(self, stage: int) -> int:
        """The rank that runs (virtual) stage ``stage``."""
        if self.placement is not None:
            for r, held in enumerate(self.placement):
                if stage in held:
                    return r
            raise ValueError(f"stage {stage} is on no rank of placement {self.placement}")
        return stage % self.ranks

    def rank_sequence(self, rank: int) -> list[tuple[int, int]]:
        """Rank ``rank``'s actions in the order it runs them, as (stage, index) pairs."""
        if self.rank_order is None:
            return [(rank, i) for i in range(len(self.actions[rank]))]
        nxt: dict[int, int] = {}
        out = []
        for vs in self.rank_order[rank]:
            i = nxt.get(vs, 0)
            nxt[vs] = i + 1
            out.append((vs, i))
        return out

    @property
    def num_micro_batches(self) -> int:
        """T * M: micro-batches covered, numbered 0 .. T*M-1."""
        return self.steps * self.chunks

    @property
    def has_comms(self) -> bool:
        """Whether the schedule spells out sends and receives."""
        return any(a.kind.is_comm for acts in self.actions for a in acts)

    def split_mbs(self, stage: int) -> frozenset[int]:
        """Micro-batches whose backward ``stage`` splits into B (input gradient) and W."""
        return frozenset(a.mb for a in self.actions[stage] if a.kind is Kind.WEIGHT)

    def releases_activations(self, stage: int, action: Action, split: frozenset[int]) -> bool:
        """Whether ``action`` ends the life of its micro-batch's activations on ``stage``: the
        W of a split backward (it still reads them), else the B. ``split``: split_mbs(stage)."""
        if action.kind is Kind.WEIGHT:
            return True
        return action.kind is Kind.BACKWARD and action.mb not in split

    def stage_actions(self, stage: int, kinds: Sequence[Kind] | None = None) -> list[Action]:
        """Stage ``stage``'s actions, optionally only those of the given kinds."""
        acts = self.actions[stage]
        return list(acts) if kinds is None else [a for a in acts if a.kind in kinds]
