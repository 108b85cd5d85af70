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

Memory of hand-offs without ``record_stream``: a tensor made on one stream
and read on another must not have its block handed out again by the caching allocator
before the reader is done. ``record_stream`` does that by recording an allocator event at
free and polling it with ``cudaEventQuery``; here each handed-over tensor's storage is
instead *held* (one reference per storage) and released in :meth:`StageStreams.wait_caller`,
right after every stage stream waited for the caller's event, once (a) nothing else
references the storage and (b) that was already so at a :meth:`~StageStreams.join` (or no
stage-stream work was enqueued since the last join). Then every use of the storage was
enqueued before that join, the caller's stream is ordered after it, and every later
allocation from the freed block -- on the producer's stream, which now waits for the
caller, or on the caller's -- is ordered after every reader. The cost: a handed-over
tensor's memory lives past its last use until the next step's start (one step's
hand-offs at most; a storage whose last reference goes after the step's final join waits
one step more). docs/ALGORITHMS.md, "Eager stage streams".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from engine.runtime.stage import trees

__all__ = ["CPUStream", "CPU_STREAM", "CUDABackend", "StageStreams", "default_stage_streams"]


class CPUStream:
    """The stream of a CPU stage: work runs in program order, nothing to synchronise."""

    def __repr__(self) -> str:
        return "CPUStream"


CPU_STREAM = CPUStream()


def default_stage_streams(on_cuda: bool, l2: bool, captured_async: bool = False) -> bool:
    """Whether ``cuda_streams=None`` gives each stage a stream of its own: with
    ``l2_persistence`` (each stage's L2 window lives on its stage stream), and where an
    asynchronous schedule's windows are captured (``cuda_graphs="program"``), where the
    stages' branches then run concurrently inside each graph.

    Why: inside a captured window the stages' branches run concurrently, which a captured
    pb window at batch 1 turns into a step several times shorter than on one stream;
    eager, the kernels at batch 1 are too short for stages to overlap, and each hand-off
    costs an event record and a stream wait on the host, so streams lose (the measurements:
    bench/README.md, "Captured step programs on one H100"). Synchronous schedules captured
    with stage streams are exact (tests/runtime/test_stream_events.py) but their speed is not
    measured: off there, as eager; ``cuda_streams=True`` turns them on anywhere."""
    return on_cuda and (l2 or captured_async)


_NULL = contextlib.nullcontext()


class CUDABackend:
    """The CUDA calls :class:`StageStreams` makes, in one place: a recording fake with the same
    methods (engine.testing.stream_recorder) runs the very same stream logic on a CPU and
    counts every event record, wait and allocator hand-over per step."""

    def stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def current(self, device: torch.device | None) -> Any:
        return torch.cuda.current_stream(device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record_stream(self, tensor: Tensor, stream: Any) -> None:
        """Tell the caching allocator ``tensor`` is used on ``stream`` (on free it records an
        event there and polls it before reusing the block). Only for tensors without a
        storage to hold (sparse ones): dense hand-offs are held instead (module docstring)."""
        if tensor.is_cuda:
            tensor.record_stream(stream)


class StageStreams:
    """One stream per stage index; ``cuda`` selects real CUDA streams (all on ``device``).

    ``backend``: where streams and events come from (default: CUDA when ``device`` is a CUDA
    device, else none: the CPU stand-in, every method a no-op). ``separate`` is True when
    stages have streams of their own, so each action runs on its stage's stream and every
    hand-off between stages carries an event."""

    def __init__(
        self, stages: Iterable[int], device: torch.device | None = None, backend: Any = None
    ) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.device = device
        if backend is None and self.cuda:
            backend = CUDABackend()
        self.backend = backend
        self.separate = backend is not None
        if backend is not None:
            self.streams: dict[int, Any] = {s: backend.stream(device) for s in stages}
        else:
            self.streams = dict.fromkeys(stages, CPU_STREAM)
        #: handed-over storages still referenced elsewhere (or not yet seen alone at a join),
        #: one per storage: its StorageImpl's address -> the storage
        self.memory_held: dict[int, Any] = {}
        #: handed-over storages read on the caller's stream only (losses): released at a
        #: wait_caller once alone -- their reads come before its event, no join needed
        self.memory_to_caller: dict[int, Any] = {}
        #: storages nothing else referenced at the last join: released at the next wait_caller
        self.memory_ready: list[Any] = []
        #: no stage-stream work was enqueued since the last join
        self.memory_clean = True
        #: the backend's observer of hand-overs (the recording backend's; None for CUDA)
        self._watch = getattr(backend, "watch", None)

    def on(self, stage: int) -> contextlib.AbstractContextManager[Any]:
        """Enqueue the block's work on ``stage``'s stream."""
        if not self.separate:
            return _NULL
        self.memory_clean = False
        return self.backend.use(self.streams[stage])

    def record(self, stage: int) -> Any:
        """An event marking the work enqueued so far on ``stage``'s stream (None on CPU)."""
        if not self.separate:
            return None
        ev = self.backend.event()
        ev.record(self.streams[stage])
        return ev

    def wait(self, stage: int, event: Any, tensor: Any = None) -> None:
        """Make ``stage``'s stream wait for ``event`` before using ``tensor`` (produced on
        another stream); the caching allocator is told the tensor is used here."""
        if not self.separate or event is None:
            return
        stream = self.streams[stage]
        stream.wait_event(event)
        for t in _tensors(tensor):
            self._hold(t, event, (stream,))

    def wait_caller(self) -> None:
        """Every stage stream starts after the work the caller's stream enqueued so far
        (inputs, weights the caller wrote, e.g. load_state_dict): one event on the caller's
        stream, waited for by each stage (``wait_stream`` would record one per stage)."""
        if not self.separate:
            return
        ev = self.backend.event()
        ev.record(self.backend.current(self.device))
        for stream in self.streams.values():
            stream.wait_event(ev)
        # now every later allocation, on any stream, is ordered after the caller's event,
        # hence after the join that saw these storages alone (module docstring)
        release = self.memory_ready
        if self.memory_clean:
            release += self._alone(self.memory_held)
        if self.memory_to_caller:
            release += self._alone(self.memory_to_caller)
        self.memory_ready = []
        release.clear()

    def join(self) -> None:
        """The caller's stream waits for every stage stream (before it reads results)."""
        if not self.separate:
            return
        caller = self.backend.current(self.device)
        for stream in self.streams.values():
            caller.wait_stream(stream)
        self.memory_clean = True
        if self.memory_held:
            self.memory_ready += self._alone(self.memory_held)

    def to_caller(self, tensor: Any, stage: int) -> None:
        """``tensor`` (made on ``stage``'s stream) is read on the caller's stream."""
        if self.separate and isinstance(tensor, Tensor):
            self._hold(tensor, self.streams[stage], (self.backend.current(self.device),), True)

    def from_caller(self, tensors: Iterable[Any], stages: Iterable[int]) -> None:
        """Inputs made on the caller's stream are read on ``stages``' streams."""
        if not self.separate:
            return
        readers = tuple(self.streams[s] for s in stages)
        if not readers:
            return
        caller = self.backend.current(self.device)
        for x in tensors:
            for t in _tensors(x):
                self._hold(t, caller, readers)

    def shared(self, tensor: Tensor, stage: int) -> None:
        """``tensor`` (made on ``stage``'s stream) is read on every stage's stream (a
        skip_update flag rides on the micro-batch's stash entries)."""
        if self.separate:
            self._hold(tensor, self.streams[stage], tuple(self.streams.values()))

    # ------------------------------------------------------------------ hand-over memory

    def _hold(
        self, t: Tensor, producer: Any, readers: tuple[Any, ...], to_caller: bool = False
    ) -> None:
        """Keep ``t``'s storage until it is safe to free (module docstring). ``producer``: the
        stream it was made on (or an event recorded there), ``readers``: where it is read
        (``to_caller``: the caller's stream only)."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (sparse): the allocator's way
            for r in readers:
                self.backend.record_stream(t, r)
            return
        if st.data_ptr() == 0:  # no memory, nothing to protect
            return
        key = st._cdata  # the StorageImpl (alive: held)
        if to_caller and key not in self.memory_held:
            self.memory_to_caller.setdefault(key, st)
        else:
            self.memory_to_caller.pop(key, None)
            self.memory_held.setdefault(key, st)
        if self._watch is not None:
            self._watch(st, producer, readers)

    @staticmethod
    def _alone(held: dict[int, Any]) -> list[Any]:
        """The storages of ``held`` nothing else references, taken out of it."""
        alone = [k for k, st in held.items() if _use_count(st._cdata) == _ALONE]
        return [held.pop(k) for k in alone]


_use_count = torch._C._storage_Use_Count  # references to a storage (ours counts one)


def _alone_count() -> int:
    """The use count of a storage whose only holder is one Python storage object: measured,
    not assumed (the builds count the object's reference; a build that counted otherwise
    would otherwise never release anything)."""
    st = torch.empty(1).untyped_storage()  # (the tensor is gone by now)
    return _use_count(st._cdata)


_ALONE = _alone_count()


def _tensors(x: Any) -> list[Tensor]:
    """The tensors of an activation, a gradient (list) or an input tree."""
    if isinstance(x, Tensor):
        return [x]
    if x is None:
        return []
    return trees.tensors(x)
