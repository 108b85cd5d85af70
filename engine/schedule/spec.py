"""A schedule resolved once: the facts a pipeline needs, from a family name or a program.

Why: ``Pipeline(schedule=...)`` accepts a built-in family name ("pb"), a schedule program as
an IR object (:class:`~engine.schedule.ir.Schedule`) or the program's text form. Everything
downstream (the step compiler, the weight policy, the delays, the checkpoints) works from one
:class:`ScheduleSpec` built here, so no module re-decodes names or re-parses text, and a
user-written program runs through exactly the same machinery as a built-in one.

A program is *finite*: it covers ``steps`` mini-batches of ``chunks`` micro-batches and ends
drained. It is lowered (communication added when it has none, see :mod:`lower`) and
validated before anything runs. A program is *synchronous* when every stage's list is a
sequence of per-mini-batch blocks, each applying exactly its own micro-batches' gradients
(see :func:`~engine.schedule.lower.flushes_every_minibatch`); otherwise the pipeline runs it
asynchronously: ``step()`` j runs every action of the program up to the forwards of
micro-batches not fed yet, and the ``steps``-th call also runs the final drain, after which
the program starts over.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.schedule.auto import CHOOSERS
from engine.schedule.catalog import ROWS, lookup, unknown_schedule
from engine.schedule.ir import Kind, Schedule
from engine.schedule.lower import add_comms, flushes_every_minibatch
from engine.schedule.text import parse
from engine.schedule.validate import validate

__all__ = ["ScheduleSpec", "resolve_schedule"]


@dataclass(frozen=True)
class ScheduleSpec:
    """What runs: ``name`` (a family or the program's name), S, M, k, order, the IR weight
    policy, whether it flushes every mini-batch, and the lowered program (None for a
    built-in family, whose streams are open-ended)."""

    name: str
    stages: int
    chunks: int
    update_size: int
    order: str
    weights: str
    synchronous: bool
    program: Schedule | None = None
    #: backwards are split into B (input gradient) and a later W (weight gradient)
    split_backward: bool = False
    #: with split_backward, per stage the micro-batches (index within a step) whose backward
    #: is split, when only some are (DualPipeV); None: every backward is split
    split_only: tuple[frozenset[int], ...] | None = None

    @property
    def is_program(self) -> bool:
        return self.program is not None

    def describe(self) -> str:
        what = "program" if self.is_program else "schedule"
        return (
            f"{what} {self.name!r} (S={self.stages}, M={self.chunks}, k={self.update_size}, "
            f"order={self.order}, weights={self.weights})"
        )


def _looks_like_text(value: str) -> bool:
    return "\n" in value or value.lstrip().startswith("schedule ")


def resolve_schedule(
    schedule: object,
    *,
    stages: int,
    chunks: int | None,
    update_size: int | None = None,
    order: str | None = None,
    virtual_stages: int | None = None,
) -> ScheduleSpec:
    """Resolve ``schedule`` (a family name, a :class:`Schedule` or its text) for a pipeline of
    ``stages`` stages. Raises ValueError (``ScheduleError`` for a broken program) naming what
    is wrong; nothing is built yet when it does.

    A rank-program family (its catalog row has a program builder: interleaved, zbv, vhalf,
    vmin, dualpipev, looped_bfs) resolves to the one-mini-batch program the row builds over
    the ``stages`` stage modules; the round-robin ones need ``virtual_stages`` v >= 2 dividing
    ``stages`` (rank r running r, r+R, ...), the V ones place 2 per rank."""
    row = lookup(schedule)
    if row is not None and row.is_program:
        schedule = row.program_for(
            stages, chunks, update_size=update_size, order=order, virtual_stages=virtual_stages
        )
    elif virtual_stages is not None:
        takes = " or ".join(repr(r.name) for r in ROWS if r.is_program and r.takes_virtual_stages)
        raise ValueError(
            f"virtual_stages={virtual_stages!r} is only for schedule={takes} (or a "
            f"program with virtual stages), not {schedule!r}; leave it unset"
        )
    if isinstance(schedule, str) and _looks_like_text(schedule):
        schedule = parse(schedule)
    if isinstance(schedule, Schedule):
        return _resolve_program(schedule, stages, chunks, update_size, order)
    if not isinstance(schedule, str):
        raise TypeError(
            "schedule must be a family name such as 'pb', a engine.schedule.Schedule program "
            f"or its text form, got {type(schedule).__name__}"
        )
    fam = lookup(schedule)
    if fam is None:  # the pipeline also takes its choosers (engine/schedule/auto.py)
        raise ValueError(unknown_schedule(schedule, also=CHOOSERS))
    if chunks is None:
        raise ValueError(f"schedule={schedule!r} needs chunks=M (micro-batches per step)")
    order = fam.check_order(order)
    k = fam.check(stages, chunks, update_size)
    return ScheduleSpec(
        name=fam.name,
        stages=stages,
        chunks=chunks,
        update_size=k,
        order=order,
        weights=fam.weights,
        synchronous=fam.synchronous,
        split_backward=fam.split_backward,
    )


def _resolve_program(
    program: Schedule,
    stages: int,
    chunks: int | None,
    update_size: int | None,
    order: str | None,
) -> ScheduleSpec:
    mismatches = [
        f"{what}={given} but the program says {have}"
        for what, given, have in (
            ("stages", stages, program.stages),
            ("chunks", chunks, program.chunks),
            ("update_size", update_size, program.update_size),
            ("order", order, program.order),
        )
        if given is not None and given != have
    ]
    if mismatches:
        raise ValueError(
            f"the schedule program {program.name!r} does not fit this pipeline: "
            + "; ".join(mismatches)
            + " (a program fixes its stages, chunks, update size and order: leave those "
            "options unset or equal to the program's header)"
        )
    split, split_only = _split_backward(program)
    lowered = add_comms(program)
    validate(lowered)
    if split_only is not None and not flushes_every_minibatch(lowered):
        raise ValueError(
            f"the schedule program {program.name!r} splits the backwards of only some "
            "micro-batches; the runtime runs that in synchronous programs only (every W in the "
            "mini-batch of its B)"
        )
    return ScheduleSpec(
        name=program.name,
        stages=program.stages,
        chunks=program.chunks,
        update_size=program.update_size,
        order=program.order,
        weights=program.weights,
        synchronous=flushes_every_minibatch(lowered),
        program=lowered,
        split_backward=split,
        split_only=split_only,
    )


def _split_backward(program: Schedule) -> tuple[bool, tuple[frozenset[int], ...] | None]:
    """Whether the program splits backwards into B and W, and when it splits only some, per
    stage the micro-batches it splits (as indices within their step, what the runtime sees)."""
    split = [program.split_mbs(s) for s in range(program.stages)]
    if not any(split):
        return False, None
    partial = any(
        {a.mb for a in acts if a.kind is Kind.BACKWARD} - split[s]
        for s, acts in enumerate(program.actions)
    )
    if not partial:
        return True, None
    M = program.chunks
    return True, tuple(frozenset(m % M for m in mbs) for mbs in split)
