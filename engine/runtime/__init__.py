"""Pipeline runtime: stages, weight versions, activation stash, executor, ``Pipeline``.

Files, one concept each: ``plan`` (schedule names; the action streams themselves and the
delays come from ``engine.schedule``), ``weights`` (live weights + version slots), ``policy``
(which weights F and B read), ``optim_bridge`` (what the runtime asks of a stage optimizer),
``stash`` (activations between F and B), ``stage`` (F/B/U on one stage), ``executor`` (runs
the schedule IR's streams over a transport, and the clock), ``transport/`` (local mailboxes
with optional CUDA streams, gloo/NCCL point-to-point, the replica x stage layout),
``distributed`` (handshake, loss sharing, data-parallel all-reduce of one rank),
``pipeline`` (the user-facing ``Pipeline``), ``probe`` (instrumentation layer for tests),
``errors``.
"""

from __future__ import annotations

from engine.runtime.errors import (
    CheckpointError,
    NonFiniteLossError,
    NotFlushedError,
    PipelineConfigError,
    PipelineInputError,
)
from engine.runtime.pipeline import Pipeline
from engine.runtime.probe import Probe
from engine.runtime.transport.base import PeerError, ShapeAgreementError

__all__ = [
    "Pipeline",
    "Probe",
    "PeerError",
    "ShapeAgreementError",
    "CheckpointError",
    "NonFiniteLossError",
    "NotFlushedError",
    "PipelineConfigError",
    "PipelineInputError",
]
