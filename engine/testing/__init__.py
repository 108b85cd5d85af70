"""Test instrumentation that ships with the library: layers that record which weights each
forward and backward of a pipeline read, and a fault injector for exception-safety tests.

Imported by name (not re-exported here, so ``import engine.testing`` stays light):
``engine.testing.launch_count`` (aten calls per action), ``engine.testing.stream_recorder``
(stream events per step, on CPU), ``engine.testing.arena_twin`` (a CUDA arena's stream/event
ordering, run on a traced CPU arena and checked for races) and ``engine.testing.nccl_twin``
(a ``torch.distributed`` backend, ``"nccl_twin"``, that enforces NCCL's ordering rules on CPU
tensors and reports deadlocks).

The CUDA-graph twins live in the capture wing (``engine.runtime.capture``); their old names
here still import, with a DeprecationWarning, until 0.3."""

from __future__ import annotations

from engine.testing.faults import FaultInjector, InjectedFault
from engine.testing.probe import Probe

__all__ = ["Probe", "FaultInjector", "InjectedFault"]
