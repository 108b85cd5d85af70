"""Every exception the library raises on purpose, in one leaf module.

Why one module: a user writes ``except engine.PipelineConfigError`` without knowing which
sub-package raised it, and a leaf (no imports from the rest of ``engine``, no torch) can be
imported by every layer -- schedule, arena, optim, runtime, transports -- without creating
import cycles. The sub-packages re-export the names they raise, so older import paths keep
working.

Each class subclasses the builtin exception a generic handler would catch anyway
(``ValueError`` for bad configuration or input, ``RuntimeError`` for misuse of a running
pipeline or a dead peer), and every message names what is wrong and how to fix it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ArenaError",
    "CheckpointError",
    "NonFiniteLossError",
    "NotFlushedError",
    "PeerError",
    "PeerStepError",
    "PipelineConfigError",
    "PipelineInputError",
    "ScheduleError",
    "ShapeAgreementError",
    "SlotError",
]


class PipelineConfigError(ValueError):
    """An invalid schedule, option or option combination, raised before anything runs."""


class PipelineInputError(ValueError):
    """A batch or a stage's output that the pipeline cannot run, raised before weights change."""


class NonFiniteLossError(FloatingPointError):
    """A micro-batch produced a NaN or infinite loss and ``on_nonfinite="raise"`` is set."""


class NotFlushedError(RuntimeError):
    """State was requested from a pipeline that still has micro-batches in flight."""


class CheckpointError(ValueError):
    """A checkpoint file or state dict that cannot be loaded (corrupt, truncated, mismatched)."""


class PeerError(RuntimeError):
    """A peer stage did not deliver (died, timed out, or the connection broke)."""


class PeerStepError(PeerError):
    """Another rank's stage raised inside this step, and every rank rolled the step back
    (synchronous steps under gloo): the pipeline is consistent, the step can be retried."""


class ShapeAgreementError(ValueError):
    """A tensor sent between two stages does not match the shape/dtype agreed at the handshake."""


class ScheduleError(ValueError):
    """A schedule violates a rule; ``stage``/``index``/``action`` locate the offending action.

    A ``ValueError`` carrying the location, so a message like "stage 1, action 4 (B3):
    backward before its forward F3" can also be inspected programmatically.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: int | None = None,
        index: int | None = None,
        action: Any = None,
    ) -> None:
        self.stage = stage
        self.index = index
        self.action = action
        if stage is not None and index is not None and action is not None:
            message = f"stage {stage}, action {index} ({action}): {message}"
        elif stage is not None:
            message = f"stage {stage}: {message}"
        super().__init__(message)


class ArenaError(ValueError):
    """Input the weight arena cannot take (raised before any parameter was moved)."""


class SlotError(LookupError):
    """A weight slot that does not exist, was already freed, or is not pinned as claimed."""
