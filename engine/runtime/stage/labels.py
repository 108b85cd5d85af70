"""What the runtime is doing right now: profiler labels and the current action.

Why a module of its own: the executor and the stages label their actions for profiler traces
(``stage2/F17``, ``stage2/B17``, ``stage2/U5``, as torch.distributed.pipelining does), and
test instrumentation (:class:`engine.testing.Probe`) needs to know which action a weight was
read in. Both are on the hot path, so both are cheap:

* ``profiling()`` is True only while a torch profiler records; a ``record_function`` label
  costs a dispatcher round trip on enter and exit even with no profiler attached, so labels
  are entered only then.
* ``CURRENT`` is a plain module attribute, ``(stage, micro-batch, kind)`` while a stage runs
  a forward (``"F"``) or a backward (``"B"``), else None. A pipeline runs its stages from one
  thread, so a context variable's cost (a set and a reset per action) buys nothing here. When one
  autograd call runs the backwards of several stages (the executor chains synchronous stages
  and batches independent stage backwards, saving a fixed engine cost per call), ``ACTIVE``
  maps each of those stages to its (micro-batch, kind).
"""

from __future__ import annotations

import torch

__all__ = ["profiling", "CURRENT", "ACTIVE", "current_action"]

#: True while a torch profiler records
profiling = torch.autograd._profiler_enabled

#: (stage, micro-batch id, kind) of the action being run, or None outside a pipeline
CURRENT: tuple[int, int, str] | None = None

#: stage -> (micro-batch id, kind) while one autograd call runs several stages' backwards
#: (a chained synchronous backward, or a batch of independent stage backwards)
ACTIVE: dict[int, tuple[int, str]] = {}


def current_action() -> tuple[int, int, str] | None:
    """(stage, micro-batch id, kind) of the action being run, or None outside a pipeline."""
    return CURRENT
