"""A trace of what ran: Chrome/Perfetto trace-event JSON of a pipeline's executed actions.

Why: ``stats()`` gives bubble fractions; a user chasing a stall needs the timeline itself --
which stage ran which forward, backward, weight gradient and update when, and under
gloo/NCCL where a rank sat in a send, a receive or an all-reduce. ``with pipe.trace(path):``
records every action run inside the block and writes one JSON file in the Trace Event Format
(open it in https://ui.perfetto.dev or chrome://tracing):

* one complete event (``"ph": "X"``) per action, named as the runtime's ``torch.profiler``
  labels (``stage2/F17``, ``stage2/B17``, ``stage2/W17``, ``stage2/U5``), so a profiler trace
  recorded alongside lines up with it; ``args`` carry the micro-batch id, the weight version
  its forward read (``version_read`` at F, ``forward_version`` at B) and the live version,
  and for an update the micro-batches it applies and the version it makes;
* under gloo/NCCL also the rank's ``send``/``recv`` (the receive includes its wait),
  ``wait_sends`` and the data-parallel ``allreduce``;
* ``pid`` is the rank (0 locally), ``tid`` the stage; the process and thread names are
  metadata events. Under gloo/NCCL every rank records its own events and rank 0 writes the
  merged file: timestamps count from the barrier every rank passes when the trace starts.
  Ranks on one host share one clock exactly: ``perf_counter`` is the host's monotonic clock,
  so they all count from the host's earliest exit from that barrier (a rank the scheduler
  let out of it a millisecond late would otherwise see its events shifted a millisecond
  early -- before the forward whose activation they received); across hosts the clocks
  agree to within the barrier's exit skew.

Times are the host's: on a GPU an action's span is the time its kernels took to enqueue (a
stall shows where the host waited); record ``torch.profiler`` alongside for device times --
its ``stageS/...`` labels are the same names. While recording, every stage's backward runs as
its own autograd call (as while a profiler
records), so each has its own event. Disabled, the cost is one module-attribute check per
action (:data:`ACTIVE` is None).

``pipe.trace(path)`` only records inside a ``with`` block: called as a statement it would
record and write nothing, so the object it returns warns (RuntimeWarning) when it is
discarded without ever being entered.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

from engine import trace_events

__all__ = ["Timeline", "ACTIVE", "TraceBlock", "trace"]


class Timeline:
    """Events of one process, in microseconds since the trace's start."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self.origin = time.perf_counter_ns()
        self.stages: set[int] = set()

    def now(self) -> int:
        return time.perf_counter_ns()

    def add(self, stage: int, name: str, cat: str, t0: int, args: dict[str, Any]) -> None:
        t1 = time.perf_counter_ns()
        self.stages.add(stage)
        self.events.append(trace_events.complete(
            name, cat, (t0 - self.origin) / 1000.0, (t1 - t0) / 1000.0, self.rank, stage, args))

    def metadata(self) -> list[dict[str, Any]]:
        meta = trace_events.metadata
        return [meta("process_name", self.rank, name=f"rank {self.rank}"),
                *(meta("thread_name", self.rank, s, name=f"stage {s}") for s in sorted(self.stages))]


#: the timeline being recorded, or None (the hot path checks only this)
ACTIVE: Timeline | None = None


def _timed(tl: Timeline, fn: Any, stage: int, name: str, args_of: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = tl.now()
        try:
            return fn(*args, **kwargs)
        finally:
            tl.add(stage, name, "comm", t0, args_of(*args))

    return run


def _wrap_rank(stages: list[Any], ex: Any, tl: Timeline) -> list[tuple[Any, str, Any]]:
    """Time the rank's communication (instance attributes, put back afterwards)."""
    saved: list[tuple[Any, str, Any]] = []
    for s, tp in getattr(ex, "transports", {}).items():
        for name, args_of in (
            ("send", lambda ch, st, mb, *a: {"channel": ch, "micro_batch": mb}),
            ("recv", lambda ch, st, mb, *a: {"channel": ch, "micro_batch": mb}),
            ("wait_sends", lambda *a: {}),
        ):
            saved.append((tp, name, tp.__dict__.get(name)))
            setattr(tp, name, _timed(tl, getattr(tp, name), s, name, args_of))
    for st in stages:
        if st.grad_hook is not None:
            saved.append((st, "grad_hook", st.grad_hook))
            st.grad_hook = _timed(tl, st.grad_hook, st.index, "allreduce", lambda *a: {})
    return saved


def _host_origin(mine: int, group: Any) -> int:
    """The earliest barrier exit among the ranks on this host (module docstring)."""
    import socket

    import torch.distributed as dist

    host = socket.gethostname()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (host, mine), group=group)
    return min(origin for h, origin in gathered if h == host)


class TraceBlock(contextlib.AbstractContextManager):
    """What ``pipe.trace(path)`` returns: records while entered; warns if never entered."""

    def __init__(self, path: str | os.PathLike[str], block: contextlib.AbstractContextManager[Timeline]) -> None:
        self.path = path
        self._block = block
        self._entered = False

    def __enter__(self) -> Timeline:
        self._entered = True
        return self._block.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self._block.__exit__(*exc)

    def __del__(self) -> None:
        if not self._entered:
            warnings.warn(
                f"pipe.trace({os.fspath(self.path)!r}) was never entered, so nothing was "
                "recorded and no file written: use it as `with pipe.trace(path): ...` around "
                "the steps to record",
                RuntimeWarning,
                stacklevel=2,
            )


def trace(
    path: str | os.PathLike[str], stages: list[Any], executor: Any, rank: int | None = None,
    group: Any = None,
) -> TraceBlock:
    """Record the actions run inside the block; write ``path`` at its end (module docstring).
    Under gloo/NCCL (``rank``: this process's global rank) every rank must enter and leave the
    block (a barrier and a gather over ``group``: the world's gloo control group, None for the
    default group); ``stages`` and ``executor`` are the ones this process runs."""
    return TraceBlock(path, _record(path, stages, executor, rank, group))


@contextlib.contextmanager
def _record(
    path: str | os.PathLike[str], stages: list[Any], executor: Any, rank: int | None,
    group: Any = None,
) -> Iterator[Timeline]:
    global ACTIVE
    if ACTIVE is not None:
        raise RuntimeError("a pipeline trace is already being recorded in this process")
    distributed = rank is not None
    rank = rank if rank is not None else 0
    if distributed:
        import torch.distributed as dist

        dist.barrier(group=group)  # the common origin of every rank's clock
    tl = Timeline(rank)
    if distributed:
        tl.origin = _host_origin(tl.origin, group)
    saved = _wrap_rank(stages, executor, tl) if distributed else []
    ACTIVE = tl
    try:
        yield tl
    finally:
        ACTIVE = None
        for obj, name, old in saved:
            if old is None and name != "grad_hook":
                delattr(obj, name)
            else:
                setattr(obj, name, old)
    events = tl.metadata() + tl.events
    if distributed:
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, events, group=group)
        if rank != 0:
            return
        events = [e for part in gathered for e in part]
    trace_events.write(path, trace_events.document(events))
