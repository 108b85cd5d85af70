"""A recording stand-in for CUDA streams and events, so the executor's stream logic runs and
is counted on a CPU.

Why: on one GPU every stage has its own stream, and every hand-off between stages is ordered
by an event (engine/runtime/exec/streams.py). What that costs per step -- event records, waits,
tensors handed to the caching allocator with ``record_stream`` (each one makes the allocator
record an event when the tensor is freed and poll it with ``cudaEventQuery`` before reusing
the block) -- was only visible in a GPU profile. :class:`RecordingBackend` has the methods of
:class:`~engine.runtime.exec.streams.CUDABackend`; a :class:`~engine.runtime.exec.streams.StageStreams`
built on it runs the real stream logic (same code, same calls) with counters instead of CUDA,
so a CPU test can hold every step to exactly the schedule's cross-stage dependencies.

Hand-over memory (``backend.watch``, called by StageStreams for every tensor it holds
instead of ``record_stream``): each stream keeps a vector clock (how much of every stream's
work it is ordered after: its own blocks of work, the waits it made, transitively through
events), and every handed-over storage is watched until it is freed. At the free, the
readers' work up to the moment the storage was last referenced by anything but the
StageStreams' hold (the recorder looks at the storage's use count at every stream
operation; a storage freed without ever being held alone: up to the free) is what must
come before any reuse of the block:

* ``early_frees``: a storage freed while a stage stream that read it has work the caller's
  stream is not ordered after (not joined);
* ``violations``: a reuse that could race -- the producer's stream (whose pool takes the
  block back) runs work before it is ordered after every reader's work up to the free, or,
  for a storage made on the caller's stream, the caller is not ordered after it at the free
  (the caller's next allocation may be immediate). The caller's own reads are taken to be
  enqueued before the last event recorded on the caller before the free;
* ``lifetimes``: (caller events recorded before the hand-over, before the free) per storage,
  so a test can see each one outlived the next ``wait_caller``.

Counted (``backend.counts``): ``event_record``, ``event_wait`` (a stream waits for an event),
``record_stream`` (a tensor used on a stream other than its producer's), ``event_query``
(polling), ``synchronize`` (a host wait). ``stream.wait_stream(other)`` counts as torch
implements it: one record on ``other`` and one wait.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from engine.runtime.exec.streams import StageStreams

__all__ = ["FakeEvent", "FakeStream", "RecordingBackend", "recording_streams"]

_use_count = torch._C._storage_Use_Count


class FakeEvent:
    def __init__(self, backend: RecordingBackend) -> None:
        self.backend = backend
        self.recorded_on: FakeStream | None = None
        self.work = 0  # the work enqueued on recorded_on when recorded
        self.clock: dict[str, int] = {}  # recorded_on's vector clock then
        self.block = 0  # the fork_join block it was recorded in (0: outside any)

    def record(self, stream: FakeStream | None = None) -> None:
        self.backend._observe()
        self.block = self.backend._block
        self.recorded_on = on = stream if stream is not None else self.backend.current(None)
        if on is self.backend.caller:  # each caller event closes one epoch of its work
            on.work += 1
            on.clock[on.name] = on.work
        self.work = on.work
        self.clock = dict(on.clock)
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
        #: stream name -> the work of that stream this one is ordered after (vector clock)
        self.clock: dict[str, int] = {}
        #: freed blocks of this stream's pool: (what each reader had done at the free, what)
        self.pending: list[tuple[dict[str, int], str]] = []

    def wait_event(self, event: FakeEvent) -> None:
        if event.recorded_on is None:
            raise AssertionError(f"{self.name} waits for an event that was never recorded")
        self.backend._observe()
        watch = self.backend._watch
        if watch is not None and event.block != self.backend._block:
            # CUDA refuses this while capturing (cudaErrorStreamCaptureIsolation: "dependency
            # created on uncaptured work in another stream"), and invalidates the capture
            watch.append(f"{self.name} waits inside the captured window for an event recorded "
                         f"before it (on {event.recorded_on.name})")
        self.backend.counts["event_wait"] += 1
        self.backend.waits.append((self.name, event.recorded_on.name))
        source = event.recorded_on
        for k, v in event.clock.items():
            if self.clock.get(k, 0) < v:
                self.clock[k] = v
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
        self._block = 0  # the fork_join block running (numbered from 1), 0 outside
        self._blocks = 0
        self.early_frees: list[str] = []
        self.violations: list[str] = []
        self.lifetimes: list[tuple[int, int]] = []
        self._watched: dict[int, list[Any]] = {}  # storage id -> [producer, readers, epoch]

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
        self._observe()
        if stream is not self.caller:
            for need, what in stream.pending:
                late = [r for r, w in need.items() if r != stream.name and stream.clock.get(r, 0) < w]
                if late:
                    self.violations.append(
                        f"{stream.name} reuses the block of {what} before it is ordered after "
                        f"{', '.join(late)}'s reads")
            stream.pending = []
            stream.work += 1
            stream.clock[stream.name] = stream.work
            if self._watch is not None and not stream.forked:
                self._watch.append(f"{stream.name} runs work before it waited for the caller")
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def record_stream(self, tensor: Tensor, stream: FakeStream) -> None:
        self.counts["record_stream"] += 1

    def watch(self, storage: Any, producer: Any, readers: tuple[FakeStream, ...]) -> None:
        """A storage made on ``producer`` (a stream, or an event recorded on it) is read on
        ``readers``: follow it until it is freed (module docstring)."""
        if isinstance(producer, FakeEvent):
            producer = producer.recorded_on
        key = storage._cdata
        rec = self._watched.get(key)
        if rec is not None:
            rec[1] = rec[1] | set(readers)
            rec[4] = None
            return
        self._watched[key] = [producer, set(readers), self.caller.work, weakref.ref(storage), None]
        weakref.finalize(storage, self._freed, key)

    def _observe(self) -> None:
        """Note, for each watched storage now referenced by the hold alone, how far each of
        its readers had got: its last read came before (nothing else can reach it)."""
        for rec in self._watched.values():
            if rec[4] is None:
                st = rec[3]()
                if st is not None and _use_count(st._cdata) == 1:
                    rec[4] = {r.name: r.work for r in rec[1]}

    def _freed(self, key: int) -> None:
        producer, readers, epoch, _, need = self._watched.pop(key)
        self.lifetimes.append((epoch, self.caller.work))
        what = f"a storage made on {producer.name} (read on {', '.join(sorted(r.name for r in readers))})"
        if need is None:
            need = {r.name: r.work for r in readers}
        unjoined = [r.name for r in readers
                    if r is not self.caller and self.caller.clock.get(r.name, 0) < need[r.name]]
        if unjoined:
            self.early_frees.append(f"{what} freed before the caller joined {', '.join(unjoined)}")
        if producer is self.caller:
            if unjoined:
                self.violations.append(f"{what} freed into the caller's pool before the caller "
                                       f"is ordered after {', '.join(unjoined)}")
        else:
            producer.pending.append((need, what))

    def reset(self) -> None:
        self.counts.clear()
        self.waits.clear()
        self.early_frees.clear()
        self.violations.clear()
        self.lifetimes.clear()

    @contextlib.contextmanager
    def fork_join(self) -> Iterator[list[str]]:
        """Check the block is a fork-join of the caller's stream, what a CUDA graph captured
        on it with stage streams needs: every stage stream waits for the caller before its
        first work in the block, the caller waits for every stage stream's last work
        before the block ends, and no stream waits for an event recorded before the block
        (CUDA's capture isolation). Yields the list of violations (filled at the end)."""
        self._watch = found = []
        self._blocks += 1
        self._block = self._blocks
        for st in self._made_streams:
            st.forked = False
        try:
            yield found
        finally:
            self._watch = None
            self._block = 0
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
