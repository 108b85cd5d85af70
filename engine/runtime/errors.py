"""Exceptions of the pipeline runtime (defined in the leaf module :mod:`engine.errors`)."""

from __future__ import annotations

from engine.errors import (
    CheckpointError,
    NonFiniteLossError,
    NotFlushedError,
    PeerError,
    PipelineConfigError,
    PipelineInputError,
    ShapeAgreementError,
)

__all__ = [
    "PipelineConfigError",
    "PipelineInputError",
    "NonFiniteLossError",
    "NotFlushedError",
    "CheckpointError",
    "PeerError",
    "ShapeAgreementError",
]
