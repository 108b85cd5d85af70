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

from engine.schedule.catalog import family
from engine.schedule.interleaved import NAME as INTERLEAVED
from engine.schedule.interleaved import interleaved
from engine.schedule.ir import Kind, Schedule
from engine.schedule.lower import add_comms, flushes_every_minibatch
from engine.schedule.text import parse
from engine.schedule.validate import validate
from engine.schedule.vshape import RANK_PROGRAMS, dualpipev, looped_bfs, zbv

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

    ``"interleaved"`` (interleaved 1F1B) needs ``virtual_stages`` v >= 2 dividing ``stages``
    (the stage modules are the S*v virtual stages, rank r running r, r+S, ...); it resolves
    to the one-mini-batch program :func:`~engine.schedule.interleaved.interleaved` builds."""
    if schedule == INTERLEAVED:
        schedule = _interleaved_program(stages, chunks, update_size, order, virtual_stages)
    elif isinstance(schedule, str) and schedule in RANK_PROGRAMS:
        schedule = _rank_program(schedule, stages, chunks, update_size, order, virtual_stages)
    elif virtual_stages is not None:
        raise ValueError(
            f"virtual_stages={virtual_stages!r} is only for schedule='interleaved' (or a "
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
    fam = family(schedule)
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


def _interleaved_program(
    stages: int, chunks: int | None, update_size: int | None, order: str | None, v: int | None
) -> Schedule:
    if v is None:
        raise ValueError(
            "schedule='interleaved' needs virtual_stages=v (stage modules per rank, >= 2)"
        )
    if isinstance(v, bool) or not isinstance(v, int) or v < 2 or stages % v:
        raise ValueError(
            f"virtual_stages={v!r} must be an int >= 2 dividing the number of stage modules "
            f"({stages}): the modules are the ranks * v virtual stages"
        )
    if chunks is None:
        raise ValueError("schedule='interleaved' needs chunks=M (micro-batches per step)")
    if update_size not in (None, chunks):
        raise ValueError(
            f"'interleaved' updates once per mini-batch, so update_size must equal chunks "
            f"(M={chunks}), got {update_size}; drop update_size"
        )
    if order not in (None, INTERLEAVED):
        raise ValueError(f"schedule 'interleaved' runs in its own order, not {order!r}")
    return interleaved(stages // v, v, chunks)


def _rank_program(
    name: str, stages: int, chunks: int | None, update_size: int | None, order: str | None,
    v: int | None,
) -> Schedule:
    """``zbv``/``dualpipev`` (2 stages per rank, as a V) and ``looped_bfs`` (v per rank,
    round-robin): one-mini-batch programs over the ``stages`` stage modules."""
    if chunks is None:
        raise ValueError(f"schedule={name!r} needs chunks=M (micro-batches per step)")
    if update_size not in (None, chunks):
        raise ValueError(
            f"{name!r} updates once per mini-batch, so update_size must equal chunks "
            f"(M={chunks}), got {update_size}; drop update_size"
        )
    if order not in (None, name):
        raise ValueError(f"schedule {name!r} runs in its own order, not {order!r}")
    if name == "looped_bfs":
        if v is None or isinstance(v, bool) or not isinstance(v, int) or v < 2 or stages % v:
            raise ValueError(
                f"schedule='looped_bfs' needs virtual_stages=v, an int >= 2 dividing the "
                f"number of stage modules ({stages}), got {v!r}"
            )
        return looped_bfs(stages // v, v, chunks)
    if v not in (None, 2):
        raise ValueError(f"{name!r} places exactly 2 stages per rank; drop virtual_stages={v!r}")
    if stages % 2:
        raise ValueError(
            f"{name!r} places 2 stages per rank as a V (rank r holds r and 2R-1-r): the number "
            f"of stage modules must be even, got {stages}"
        )
    return (zbv if name == "zbv" else dualpipev)(stages // 2, chunks)


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
