"""A recording stand-in for CUDA streams and events, so the executor's stream logic runs and
is counted on a CPU.

Why: on one GPU every stage has its own stream, and every hand-off between stages is ordered
by an event (engine/runtime/exec/streams.py). What that costs per step -- event records, waits,
tensors handed to the caching allocator with ``record_stream`` (each one makes the allocator
record an event when the tensor is freed and poll it with ``cudaEventQuery`` before reusing
the block) -- was only visible in a GPU profile (issue 23: 128 records, 128 waits, 120
queries per pb step). :class:`RecordingBackend` has the methods of
:class:`~engine.runtime.exec.streams.CUDABackend`; a :class:`~engine.runtime.exec.streams.StageStreams`
built on it runs the real stream logic (same code, same calls) with counters instead of CUDA,
so a CPU test can hold every step to exactly the schedule's cross-stage dependencies.

Counted (``backend.counts``): ``event_record``, ``event_wait`` (a stream waits for an event),
``record_stream`` (a tensor used on a stream other than its producer's), ``event_query``
(polling), ``synchronize`` (a host wait). ``stream.wait_stream(other)`` counts as torch
implements it: one record on ``other`` and one wait.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from engine.runtime.exec.streams import StageStreams

__all__ = ["FakeEvent", "FakeStream", "RecordingBackend", "recording_streams"]


class FakeEvent:
    def __init__(self, backend: RecordingBackend) -> None:
        self.backend = backend
        self.recorded_on: FakeStream | None = None
        self.work = 0  # the work enqueued on recorded_on when recorded

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorded_on = stream if stream is not None else self.backend.current(None)
        self.work = self.recorded_on.work
        self.backend.counts["event_record"] += 1

    def query(self) -> bool:
        self.backend.counts["event_query"] += 1
        return True

    def synchronize(self) -> None:
        self.backend.counts["synchronize"] += 1

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.backend.current(None)).wait_event(self)


class FakeStream:
    def __init__(self, backend: RecordingBackend, name: str) -> None:
        self.backend = backend
        self.name = name
        self.work = 0  # blocks of work enqueued (``backend.use`` entries)
        self.joined = 0  # the caller has waited for the work up to here
        self.forked = False  # waited for the caller since the last ``backend.fork_join()``

    def wait_event(self, event: FakeEvent) -> None:
        if event.recorded_on is None:
            raise AssertionError(f"{self.name} waits for an event that was never recorded")
        self.backend.counts["event_wait"] += 1
        self.backend.waits.append((self.name, event.recorded_on.name))
        source = event.recorded_on
        if self is self.backend.caller:
            source.joined = max(source.joined, event.work)
        elif source is self.backend.caller:
            self.forked = True

    def wait_stream(self, other: FakeStream) -> None:
        ev = FakeEvent(self.backend)
        ev.record(other)
        self.wait_event(ev)

    def query(self) -> bool:
        self.backend.counts["event_query"] += 1
        return True

    def synchronize(self) -> None:
        self.backend.counts["synchronize"] += 1

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class RecordingBackend:
    """The methods of :class:`~engine.runtime.exec.streams.CUDABackend`, counting instead of
    calling CUDA. ``waits`` lists (waiting stream, stream the event was recorded on)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.waits: list[tuple[str, str]] = []
        self.caller = FakeStream(self, "caller")
        self._current = [self.caller]
        self._made = 0
        self._made_streams: list[FakeStream] = []
        self._watch: list[str] | None = None

    def stream(self, device: Any) -> FakeStream:
        self._made += 1
        st = FakeStream(self, f"stage-stream-{self._made - 1}")
        self._made_streams.append(st)
        return st

    def current(self, device: Any) -> FakeStream:
        return self._current[-1]

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        if stream is not self.caller:
            stream.work += 1
            if self._watch is not None and not stream.forked:
                self._watch.append(f"{stream.name} runs work before it waited for the caller")
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def record_stream(self, tensor: Tensor, stream: FakeStream) -> None:
        self.counts["record_stream"] += 1

    def reset(self) -> None:
        self.counts.clear()
        self.waits.clear()

    @contextlib.contextmanager
    def fork_join(self) -> Iterator[list[str]]:
        """Check the block is a fork-join of the caller's stream, what a CUDA graph captured
        on it with stage streams needs: every stage stream waits for the caller before its
        first work in the block, and the caller waits for every stage stream's last work
        before the block ends. Yields the list of violations (filled at the end)."""
        self._watch = found = []
        for st in self._made_streams:
            st.forked = False
        try:
            yield found
        finally:
            self._watch = None
            for st in self._made_streams:
                if st.work > st.joined:
                    found.append(f"{st.name}'s last work is not joined to the caller")


def recording_streams(pipe: Any) -> RecordingBackend:
    """Give ``pipe`` (local transport, CPU) per-stage streams on a recording backend; returns
    the backend. The executor then runs exactly its CUDA-streams path: every action on its
    stage's stream, one backward per autograd call, an event per hand-off."""
    backend = RecordingBackend()
    streams = StageStreams([st.index for st in pipe.stages], torch.device("cpu"), backend=backend)
    pipe.parts.streams = streams
    pipe.parts.executor.streams = streams
    return backend
