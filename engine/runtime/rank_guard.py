"""What an exception or a Ctrl-C inside a multi-process step leaves behind (one rank's view).

Why a module: the local step protocol's pieces (:mod:`~engine.runtime.rollback`,
:mod:`~engine.runtime.interrupts`, the notes of :mod:`~engine.runtime.failures`) are reused
by :class:`~engine.runtime.rank.RankExecutor` through these few helpers, so the rules stay
written once. What differs under gloo/NCCL is only what a *single* rank can decide alone:

* A Ctrl-C cannot stop one rank between two actions: its peers would wait for messages that
  never come. It is deferred to the end of the step (or flush) instead, which every rank
  reaches in the same state, and raised there with a note saying that the step completed (a
  second Ctrl-C still interrupts at once, for a stage that never returns).
* A synchronous step that every rank rolls back together (a non-finite loss with
  ``on_nonfinite="raise"``, an input a stage cannot take) restores the RNG state and the
  module buffers the forwards changed, as a local rollback does.
* An exception raised inside the user's forward, backward or weight gradient stops this rank
  mid-step; it carries a note saying so (the peers raise :class:`~engine.errors.PeerError`
  naming this rank, engine/runtime/first_failure.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine.errors import PipelineInputError
from engine.runtime.failures import Outcome
from engine.runtime.program import B, F, W
from engine.runtime.rollback import RollbackPoint

__all__ = ["interrupt_at_step_end", "rollback_point", "restore", "note_stopped"]


@contextmanager
def interrupt_at_step_end(executor: Any) -> Iterator[None]:
    """Run a rank's step or flush with Ctrl-C deferred; raise KeyboardInterrupt after it."""
    interrupts = executor.interrupts
    interrupts.pending = False
    with interrupts.deferred():
        yield
    if interrupts.pending:
        interrupts.pending = False
        exc = KeyboardInterrupt()
        executor._note(exc, None, 0, Outcome.COMPLETED_THEN_INTERRUPTED)
        raise exc


def rollback_point(executor: Any) -> RollbackPoint | None:
    """The RNG states and buffers at the start of a synchronous step (None: asynchronous)."""
    return RollbackPoint(executor.tracker, executor._cuda_devices()) if executor.sync else None


def restore(point: RollbackPoint | None) -> None:
    """Every rank rolled the step back: the RNG states and buffers go back too."""
    if point is None:
        return
    point.restore(stacklevel=4)


def note_stopped(executor: Any, exc: BaseException, prog: Any, base: int) -> None:
    """An exception inside this rank's forward, backward or weight gradient (the user's code;
    not an input every rank refused together): say where, and that the rank stopped mid-step."""
    lane = prog.lanes[executor.lane]
    if executor._pc >= len(lane) or isinstance(exc, PipelineInputError):
        return
    s, pc = lane[executor._pc]
    op, rel = prog.stages[s][pc]
    if op in (F, B, W):
        executor._note(exc, (op, s, rel), base, Outcome.RANK_STOPPED)
