"""Per-stage streams: CUDA streams on a GPU, a do-nothing stand-in on the CPU.

Why a stand-in (as torchgpipe's ``CPUStream``): on one GPU every stage gets its own CUDA
stream so that stages overlap, and hand-offs between stages are ordered with events. The
code that does this is on every action's path; with a CPU stand-in that has the same
interface, the very same code runs in CPU CI (where the stand-in's operations are no-ops),
instead of a CUDA-only branch that only a GPU machine ever executes.

:class:`StageStreams` holds one stream per local stage and offers exactly what the executor
needs: run on a stage's stream, hand a tensor from one stage's stream to another's, make the
stages wait for the caller's stream (inputs, weights written by the caller) and the caller
wait for the stages (before it reads losses or weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from engine.runtime import trees

__all__ = ["CPUStream", "CPU_STREAM", "StageStreams"]


class CPUStream:
    """The stream of a CPU stage: work runs in program order, nothing to synchronise."""

    def __repr__(self) -> str:
        return "CPUStream"


CPU_STREAM = CPUStream()
_NULL = contextlib.nullcontext()


class StageStreams:
    """One stream per stage index; ``cuda`` selects real CUDA streams (all on ``device``)."""

    def __init__(self, stages: Iterable[int], device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.device = device
        if self.cuda:
            self.streams: dict[int, Any] = {s: torch.cuda.Stream(device=device) for s in stages}
        else:
            self.streams = dict.fromkeys(stages, CPU_STREAM)

    def on(self, stage: int) -> contextlib.AbstractContextManager[Any]:
        """Enqueue the block's work on ``stage``'s stream."""
        if not self.cuda:
            return _NULL
        return torch.cuda.stream(self.streams[stage])

    def record(self, stage: int) -> Any:
        """An event marking the work enqueued so far on ``stage``'s stream (None on CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.streams[stage])
        return ev

    def wait(self, stage: int, event: Any, tensor: Any = None) -> None:
        """Make ``stage``'s stream wait for ``event`` before using ``tensor`` (produced on
        another stream); the caching allocator is told the tensor is used here."""
        if not self.cuda or event is None:
            return
        stream = self.streams[stage]
        stream.wait_event(event)
        for t in _tensors(tensor):
            if t.is_cuda:
                t.record_stream(stream)

    def wait_caller(self) -> None:
        """Every stage stream starts after the work the caller's stream enqueued so far
        (inputs, weights the caller wrote, e.g. load_state_dict)."""
        if not self.cuda:
            return
        caller = torch.cuda.current_stream(self.device)
        for stream in self.streams.values():
            stream.wait_stream(caller)

    def join(self) -> None:
        """The caller's stream waits for every stage stream (before it reads results)."""
        if not self.cuda:
            return
        caller = torch.cuda.current_stream(self.device)
        for stream in self.streams.values():
            caller.wait_stream(stream)

    def to_caller(self, tensor: Any) -> None:
        """``tensor`` (allocated on a stage stream) is read on the caller's stream."""
        if self.cuda and isinstance(tensor, Tensor) and tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(self.device))

    def from_caller(self, tensors: Iterable[Any], stages: Iterable[int]) -> None:
        """Inputs made on the caller's stream are read on ``stages``' streams."""
        if not self.cuda:
            return
        flat = [t for x in tensors for t in _tensors(x)]
        for s in stages:
            for t in flat:
                if t.is_cuda:
                    t.record_stream(self.streams[s])


def _tensors(x: Any) -> list[Tensor]:
    """The tensors of an activation, a gradient (list) or an input tree."""
    if isinstance(x, Tensor):
        return [x]
    if x is None:
        return []
    return trees.tensors(x)
