"""Pipeline runtime: stages, weight versions, activation stash, executor, ``Pipeline``.

Files, one concept each: ``plan`` (per-stage action streams, delay derivation), ``weights``
(live weights + version slots), ``policy`` (which weights F and B read), ``optim_bridge``
(what the runtime asks of a stage optimizer), ``stash`` (activations between F and B),
``stage`` (F/B/U on one stage), ``executor`` (local execution and the clock), ``pipeline``
(the user-facing ``Pipeline``), ``probe`` (instrumentation layer for tests), ``errors``.
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

__all__ = [
    "Pipeline",
    "Probe",
    "CheckpointError",
    "NonFiniteLossError",
    "NotFlushedError",
    "PipelineConfigError",
    "PipelineInputError",
]
