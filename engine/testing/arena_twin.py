"""The CPU twin of a CUDA weight arena: its stream/event operations, replayed on a model of
the device next to the caller's own accesses, with every unordered conflict reported.

Why: whether a snapshot, a pooled slot or a writer of the live weights races is decided by
which stream waits for which event (csrc/arena.cpp), and on a GPU a race shows only now and
then (a test passes, then fails with the same code on a busy device). :class:`ArenaTwin` traces a CPU arena (``Arena.trace_start``: the arena runs its
CUDA ordering code on the CPU buckets and logs each operation instead of calling CUDA),
stands in for the CUDA streams of :class:`~engine.arena.WeightArena` (``stream=`` arguments
and the current stream are :class:`TwinStream` objects), and replays the log in order
together with the accesses the test declares (``write``/``read`` of a tensor on a stream:
what its kernels would do there).

The model is happens-before with vector clocks. Every operation on a stream ticks that
stream's own entry; an event keeps the clock of its stream when recorded; a wait merges the
event's clock into the waiting stream (CUDA waits for the work recorded before it). A
snapshot copy, as ``copy_async`` issues it, waits for what is queued on the producer stream,
then reads live and writes the slot on the snapshot stream and records its event. When the
host learns that an event is done (a query answered done, a sync), every stream's next work
comes after it. An access is ordered after an earlier one when its stream's clock covers
that one's tick; two accesses to overlapping bytes on different streams, one of them a
write, neither ordered: a race (``races``). Event misuse, which CUDA rejects or which hangs,
goes to ``misuse``: waiting on, querying or syncing an event not recorded or already
destroyed, destroying one twice. ``host_free`` checks a buffer given back to torch's
allocator (``trim_pool``) is no longer touched by queued work.

Queries answer "pending" (``events_done=False``: a slow device, every wait is enqueued) or
"done" (``events_done=True``: a fast one, the arena skips the waits and relies on the host
having seen the event complete); a correct arena is race-free under both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ArenaTwin", "TwinStream"]


@dataclass(frozen=True)
class TwinStream:
    name: str
    handle: int


@dataclass(frozen=True)
class _Access:
    stream: int
    tick: int
    lo: int
    hi: int
    write: bool
    what: str


class ArenaTwin:
    """Trace ``arena`` (a :class:`~engine.arena.WeightArena` on the CPU, before its first
    snapshot) and model the device its CUDA twin would run on. ``default`` is the current
    stream until :meth:`use` says otherwise."""

    def __init__(self, arena: Any, *, events_done: bool = False) -> None:
        if arena.device.type != "cpu":
            raise ValueError(f"ArenaTwin traces CPU arenas only, got one on {arena.device}")
        arena._core.trace_start(events_done)
        arena._twin = self
        self.arena = arena
        self._names: dict[int, str] = {}
        self._clocks: dict[int, dict[int, int]] = {}
        self._host: dict[int, int] = {}  # what the host has seen finish
        self._events: dict[int, dict[int, int]] = {}  # recorded events: clock at the record
        self._destroyed: set[int] = set()
        self._accesses: list[_Access] = []
        self._next = 1
        self.side: int | None = None  # the snapshot stream's handle, once created
        self.ops: list[tuple[Any, ...]] = []  # every replayed operation, in order
        self.races: list[str] = []
        self.misuse: list[str] = []
        self.default = self.stream("default")
        self._current = [self.default]

    # ---- streams ----------------------------------------------------------------------

    def stream(self, name: str) -> TwinStream:
        """A new stream, ordered after nothing (as ``torch.cuda.Stream()``: non-blocking)."""
        s = TwinStream(name, self._next)
        self._next += 1
        self._names[s.handle] = name
        self._clocks[s.handle] = {}
        return s

    def current(self) -> TwinStream:
        return self._current[-1]

    def handle(self, stream: TwinStream | None) -> int:
        s = self.current() if stream is None else stream
        if not isinstance(s, TwinStream):
            raise TypeError(f"a twinned arena takes TwinStream objects, got {s!r}")
        return s.handle

    @contextlib.contextmanager
    def use(self, stream: TwinStream | None) -> Iterator[TwinStream]:
        """Make ``stream`` current (``torch.cuda.stream(stream)``); None keeps the current."""
        self._current.append(self.current() if stream is None else stream)
        try:
            yield self._current[-1]
        finally:
            self._current.pop()

    def wait_stream(self, waiter: TwinStream, producer: TwinStream) -> None:
        """``waiter.wait_stream(producer)``: waiter runs after producer's work so far."""
        self._pull()
        self._merge(self._clocks[waiter.handle], self._now(producer.handle))

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``: the host has seen every queued operation finish."""
        self._pull()
        for clock in self._clocks.values():
            self._merge(self._host, clock)

    # ---- the caller's accesses --------------------------------------------------------

    def write(self, tensor: torch.Tensor, what: str, stream: TwinStream | None = None) -> None:
        self._pull()
        self._access(self.handle(stream), tensor, True, what)

    def read(self, tensor: torch.Tensor, what: str, stream: TwinStream | None = None) -> None:
        self._pull()
        self._access(self.handle(stream), tensor, False, what)

    def host_free(self, tensor: torch.Tensor, what: str) -> None:
        """``tensor``'s memory goes back to torch's allocator now: every queued access to it
        must be one the host has seen finish."""
        self._pull()
        lo, hi = _span(tensor)
        for a in self._accesses:
            if a.lo < hi and lo < a.hi and self._host.get(a.stream, 0) < a.tick:
                self.races.append(f"{what} is freed while {a.what} on {self._names[a.stream]} "
                                  "may still run")

    def live_events(self) -> set[int]:
        """Events recorded and not destroyed yet."""
        self._pull()
        return set(self._events) - self._destroyed

    # ---- replay -------------------------------------------------------------------------

    def _now(self, stream: int) -> dict[int, int]:
        clock = self._clocks.setdefault(stream, {})
        self._merge(clock, self._host)  # enqueued after the host saw those finish
        return clock

    @staticmethod
    def _merge(into: dict[int, int], other: dict[int, int]) -> None:
        for k, v in other.items():
            if into.get(k, 0) < v:
                into[k] = v

    def _access(self, stream: int, tensor_or_span: Any, write: bool, what: str) -> None:
        lo, hi = tensor_or_span if isinstance(tensor_or_span, tuple) else _span(tensor_or_span)
        clock = self._now(stream)
        clock[stream] = clock.get(stream, 0) + 1
        new = _Access(stream, clock[stream], lo, hi, write, what)
        for a in self._accesses:
            if a.stream == stream or not (a.write or write) or not (a.lo < hi and lo < a.hi):
                continue
            if clock.get(a.stream, 0) < a.tick:
                self.races.append(f"{what} on {self._names[stream]} is not ordered after "
                                  f"{a.what} on {self._names[a.stream]}")
        self._accesses.append(new)

    def _event(self, event: int, doing: str) -> bool:
        if event not in self._events:
            self.misuse.append(f"{doing} event {event}, which was never recorded")
            return False
        if event in self._destroyed:
            self.misuse.append(f"{doing} event {event} after it was destroyed")
            return False
        return True

    def _pull(self) -> None:
        for op, stream, event, producer, dst, src, nbytes in self.arena._core.trace_take():
            self.ops.append((op, stream, event))
            if op == "create":
                self.side = stream
                self._names[stream] = "the snapshot stream"
                self._clocks[stream] = {}
            elif op == "copy":
                if producer not in self._clocks:
                    self._names[producer] = f"stream {producer}"
                self._merge(self._now(stream), self._now(producer))  # copy_async's ready event
                self._access(stream, (src, src + nbytes), False,
                             f"the snapshot copy (event {event}) reading live")
                self._access(stream, (dst, dst + nbytes), True,
                             f"the snapshot copy (event {event}) writing its slot")
                self._events[event] = dict(self._now(stream))
            elif op == "record":
                self._events[event] = dict(self._now(stream))
            elif op == "wait":
                if self._event(event, f"{self._names.get(stream, stream)} waits on"):
                    self._merge(self._now(stream), self._events[event])
            elif op == "query":
                if self._event(event, "query of") and producer:
                    self._merge(self._host, self._events[event])
            elif op == "sync":
                if self._event(event, "host sync on"):
                    self._merge(self._host, self._events[event])
            elif op == "destroy":
                if self._event(event, "destroy of"):
                    self._destroyed.add(event)
            else:
                raise AssertionError(f"unknown traced operation {op!r}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    if not t.is_contiguous():
        raise ValueError("ArenaTwin tracks contiguous tensors (flat buffers and their views)")
    lo = t.data_ptr()
    return lo, lo + t.numel() * t.element_size()
