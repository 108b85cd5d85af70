"""What an exception inside an asynchronous step leaves behind, and how it is explained.

Why a module: the executor's promise (an exception anywhere inside ``step()``/``flush()``
leaves every stage consistent) is carried out here for the asynchronous case -- what an
exception raised inside a forward, a backward, a batch of backwards or an update drops -- and
every exception gets a note saying where it happened and what the pipeline did about it
(see the executor's module docstring for the rules).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from engine.errors import NonFiniteLossError
from engine.runtime.program import BB, OP_NAMES, B, F, U, W
from engine.runtime.stage import DROPPED

if TYPE_CHECKING:
    from engine.runtime.stage import Stage
    from engine.runtime.streams import StageStreams

__all__ = ["FailureHandling", "Outcome", "nonfinite_message"]

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


def nonfinite_message(which: str, what: str) -> str:
    """The one text of a :class:`~engine.errors.NonFiniteLossError` (local executor and
    ranks): ``which`` micro-batches gave a non-finite loss, ``what`` the pipeline did."""
    return (
        f"{which} gave a non-finite loss; {what} Lower the learning rate, check the inputs, "
        "or pass on_nonfinite='skip'."
    )


class FailureHandling:
    """Mixin of :class:`~engine.runtime.executor.Executor` (uses its stages and mailboxes)."""

    by_index: dict[int, Stage]
    n_base: int
    sync: bool
    scale: float
    dropped: int
    acts: dict[tuple[int, int], tuple[Any, Any]]
    grads: dict[tuple[int, int], tuple[Any, Any]]
    streams: StageStreams

    def _batch_failed(self, items: tuple[tuple[int, int], ...], base: int) -> None:
        """A batched backward raised: every micro-batch in it is dropped at its stage."""
        for s, rel in items:
            st = self.by_index[s]
            i = base + rel
            if st.stash.get(i) is not None:  # its backward had not begun
                st.stash.pop(i)
                st.pending += 1
                st.pending_mbs.append(self.n_base + i)
                self.grads.pop((s, i), None)
            self._backward_dropped(st, i)

    def _backward_dropped(self, st: Stage, i: int) -> None:
        """Micro-batch i's backward at ``st`` failed: its update group loses the gradients
        accumulated so far, and the stage before sees the micro-batch as dropped."""
        self._discard(st)
        if st.index > 0:
            self.grads[(st.index - 1, i)] = (DROPPED, None)
        self.dropped += 1

    def _discard(self, st: Stage) -> None:
        """A backward or W failed halfway at ``st``: the gradients it accumulated for the
        current update cannot be told apart, so they go. Micro-batches whose B ran but whose W
        has not (a split backward) keep their share of the group: their weight gradients
        still come. The zeroing runs on the stage's own stream: on a GPU the gradients and skip
        flags are accumulated there, and a zero enqueued on the caller's stream could run
        before the adds still queued on the stage's (a stale found_inf skipping a later update)."""
        with self.streams.on(st.index):
            st.discard_gradients()
        st.pending_weight = sum(job.entry.scale for job in st._deferred.values())

    # ------------------------------------------------------------------ failures

    def _action_failed(self, action: tuple[int, int, Any], base: int, exc: BaseException) -> None:
        """An exception raised inside F/B/U (asynchronous step): drop what it touched."""
        op, s, rel = action
        if op == BB:  # _backward_batch already dropped every micro-batch in the batch
            self._note(exc, (B, rel[0][0], rel[0][1]), base, Outcome.BACKWARD_FAILED)
            return
        st = self.by_index[s]
        if op == U:
            self._note(exc, action, base, Outcome.UPDATE_SKIPPED)
            return
        i = base + rel
        if op == W:  # B already sent the input gradient: only the weight sums are lost
            self._discard(st)
            self.dropped += 1
            self._note(exc, action, base, Outcome.WEIGHT_GRADIENT_FAILED)
        elif op == F:
            st.drop_forward(i, self.n_base + i, self.scale)
            if not st.is_last:
                self.acts[(s + 1, i)] = (DROPPED, None)
            self.dropped += 1
            self._note(exc, action, base, Outcome.DROPPED)
        else:
            self._backward_dropped(st, i)
            self._note(exc, action, base, Outcome.BACKWARD_FAILED)

    def _note(self, exc: BaseException, action: Any, base: int, what: Outcome) -> None:
        if not hasattr(exc, "add_note"):
            return  # Python < 3.11
        if action is None:
            where = "at the end of its step"
        else:
            op, s, rel = action
            if op == BB:
                op, (s, rel) = B, rel[0]
            n = self.n_base + base + (rel if op != U else rel[-1])
            where = (
                f"at stage {s}, update {self.by_index[s].updates}"
                if op == U
                else f"at stage {s}, {OP_NAMES[op]} of micro-batch {n}"
            )
        consistent = (
            "The pipeline is consistent: flush(), save (after the flush), load and further "
            "step() calls work."
        )
        exc.add_note(f"engine.Pipeline: {type(exc).__name__} {where}: {what.value} {consistent}")

    def _nonfinite_error(self, bad: list[int]) -> NonFiniteLossError:
        if self.sync:
            what = "the step was rolled back: no weight or optimizer state changed."
        else:
            what = (
                "it was dropped at every stage (zero gradient); earlier updates stand, and the "
                "rest of the step runs at the next step() or flush()."
            )
        which = (
            f"micro-batch {bad[0]}" if len(bad) == 1 else f"micro-batches {', '.join(map(str, bad))}"
        )
        return NonFiniteLossError(nonfinite_message(which, what))
