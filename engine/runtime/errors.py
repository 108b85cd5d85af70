"""Exceptions of the pipeline runtime.

Each one names what was wrong and how to fix it; they subclass the builtin exception a user
would catch anyway (ValueError for bad configuration or input, RuntimeError for misuse of a
running pipeline) so generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "PipelineConfigError",
    "PipelineInputError",
    "NonFiniteLossError",
    "NotFlushedError",
    "CheckpointError",
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
