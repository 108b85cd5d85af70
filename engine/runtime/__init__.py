"""Pipeline runtime: compiled step programs run over stages, weight stores and transports.

Files, one concept each: ``config`` (option validation and resolution), ``build`` (stage
modules, weight stores, optimizers), ``program`` (a schedule's steps compiled once),
``protocol`` (what a step is: segments, the synchronous commit and its rollback point,
Ctrl-C, the non-finite policy, notes), ``executor`` (its runner in one process: every stage's
actions in merged order), ``lane`` (its runner on one rank: the rank's lane, abort and
dropped frames), ``failures`` (the outcomes an exception's note names), ``stage``
(F/B/U on one stage), ``weight_store`` (live weights, retired versions, the transient),
``saved_weights`` (which weights autograd's saved tensors read at the backward), ``policy``
(which weights F and B read), ``optim_bridge`` (what the runtime asks of a stage
optimizer), ``stash`` (activations between F and B), ``streams`` (CUDA streams and their
CPU stand-in), ``inputs`` (micro-batch split and the dry-run check), ``clock`` (bubble
fractions), ``labels`` (profiler labels, the current action), ``state`` (state dicts),
``distributed`` (handshake, loss sharing, data-parallel all-reduce), ``transport/`` (local
hand-offs, gloo/NCCL point-to-point, the replica x stage layout), ``parts`` (what a builder
returns and the facade holds), ``assemble`` (``build_local``), ``rank_build`` (``build_rank``),
``rank`` (a rank's executor), ``pipeline`` (the facade: nothing in runtime/ imports it).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"Pipeline": "engine.runtime.pipeline"}

__all__ = ["Pipeline"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
