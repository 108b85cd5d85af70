"""What the pipeline did about an exception inside a step, and where it happened: the
notes every such exception carries.

Why a module: the outcomes are a closed list (an Enum, gated by tests/test_layout.py), shared
by the step protocol (:mod:`~engine.runtime.exec.protocol`), which decides them, and its runners
(:mod:`~engine.runtime.exec.executor`, :mod:`~engine.runtime.ranks.rank`), which say what an action that
raised dropped. The non-finite-loss message is written here once.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from engine.runtime.exec.program import BB, OP_NAMES, B, U

if TYPE_CHECKING:
    from engine.runtime.stage.stage import Stage

__all__ = ["Outcome", "nonfinite_message", "where", "add_outcome", "discard_partial"]

class Outcome(enum.Enum):
    """What the pipeline did about an exception inside a step: the second half of the note
    the exception carries. An Enum, not strings, so a note kind without a text cannot exist
    (a missing dictionary key once turned a failed W into a ``KeyError`` that hid the user's
    exception and left the step's tail unrecorded)."""

    ROLLED_BACK = (
        "the step was rolled back: no weight, gradient, optimizer state, RNG state or module "
        "buffer changed; the same step can be retried."
    )
    PAUSED = (
        "the pipeline paused before this action; the next step() or flush() continues exactly "
        "where it stopped."
    )
    DROPPED = (
        "this micro-batch was dropped at every stage (its gradient is never applied; its "
        "update group is renormalised over the rest), and the rest of the step runs at the "
        "next step() or flush()."
    )
    BACKWARD_FAILED = (
        "this micro-batch was dropped, and the gradients this stage had accumulated for its "
        "current update were discarded (a partial backward cannot be undone); the rest of the "
        "step runs at the next step() or flush()."
    )
    WEIGHT_GRADIENT_FAILED = (
        "its input gradient had already been sent upstream, so only this stage lost it: the "
        "weight gradients this stage had accumulated for its current update were discarded "
        "(a partial sum cannot be undone; weight gradients still to come keep their share); "
        "the rest of the step runs at the next step() or flush()."
    )
    UPDATE_PHASE_FAILED = (
        "this stage's optimizer raised during the synchronous update phase: its update was "
        "skipped (its gradients discarded), every other stage updated."
    )
    UPDATE_SKIPPED = (
        "this stage's update was skipped (its gradients discarded); the rest of the step runs "
        "at the next step() or flush()."
    )
    COMPLETED_THEN_INTERRUPTED = (
        "the Ctrl-C came after the step's last action (under a multi-process transport it is "
        "deferred to the end of the step: a rank that stopped mid-step would leave its peers "
        "waiting): the step completed on this rank and is counted in pipe.steps; do not repeat "
        "it, the next step() takes the next batch."
    )
    # multi-process steps (engine/runtime/ranks/rank.py)
    RANK_STOPPED = (
        "under a multi-process transport this rank stopped in the middle of the step; its peers "
        "raise PeerError naming this rank once their timeout passes. The step cannot be undone "
        "across ranks: restart every rank from the last checkpoint (engine.load)."
    )


def nonfinite_message(which: str, what: str) -> str:
    """The one text of a :class:`~engine.errors.NonFiniteLossError` (local executor and
    ranks): ``which`` micro-batches gave a non-finite loss, ``what`` the pipeline did."""
    return (
        f"{which} gave a non-finite loss; {what} Lower the learning rate, check the inputs, "
        "or pass on_nonfinite='skip'."
    )


def where(action: Any, base: int, by_index: dict[int, Stage]) -> str:
    """Where in a step an exception happened: ``action`` is (op, stage, micro-batch relative
    to ``base``, the step's first global id; an update's list of them), None at its end."""
    if action is None:
        return "at the end of its step"
    op, s, rel = action
    if op == BB:
        op, (s, rel) = B, rel[0]
    if op == U:
        return f"at stage {s}, update {by_index[s].updates}"
    return f"at stage {s}, {OP_NAMES[op]} of micro-batch {base + rel}"


def add_outcome(exc: BaseException, at: str, what: Outcome) -> None:
    """The note an exception leaves a step with: where (``at``) and what the pipeline did."""
    if not hasattr(exc, "add_note"):
        return  # Python < 3.11
    consistent = "" if what is Outcome.RANK_STOPPED else (
        " The pipeline is consistent: flush(), save (after the flush), load and further "
        "step() calls work."
    )
    exc.add_note(f"engine.Pipeline: {type(exc).__name__} {at}: {what.value}{consistent}")


def discard_partial(st: Stage, streams: Any) -> None:
    """A backward or W failed halfway at ``st``: the gradients it accumulated for the current
    update cannot be told apart, so they go. Micro-batches whose B ran but whose W has not (a
    split backward) keep their share of the group: their weight gradients still come. The
    zeroing runs on the stage's own stream: on a GPU the gradients and skip flags are
    accumulated there, and a zero enqueued on the caller's stream could run before the adds
    still queued on the stage's (a stale found_inf skipping a later update)."""
    with streams.on(st.index):
        st.discard_gradients()
    st.pending_weight = sum(job.entry.scale for job in st._deferred.values())
