"""The handle an op posted on the twin returns (``torch.distributed.Work``'s Python face).

One work per queue entry, as ProcessGroupNCCL gives: an unbatched op, a collective, or a whole
``batch_isend_irecv`` list (NCCL returns that list's single coalesced work). ``wait()`` blocks
the calling thread until the entry completed, raising its error; on CPU the data dependence
is real, so there is no stream to hand the wait to.
"""

from __future__ import annotations

import datetime
import threading
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch.futures import Future

if TYPE_CHECKING:
    from engine.testing.nccl_twin.entries import Entry


class Waiter(Protocol):
    """What blocks a wait (engine.testing.nccl_twin.hub.Hub)."""

    def wait(self, work: TwinWork, timeout: float | None) -> None: ...


def seconds(timeout: object) -> float | None:
    """A ``wait(timeout)`` argument in seconds; None (and torch's kNoTimeout, zero) for none."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)):
        value = float(timeout)
    else:
        raise TypeError(f"wait(timeout=) takes a timedelta or seconds, got {timeout!r}")
    return value if value > 0 else None


class TwinWork(dist._Work):
    def __init__(self, hub: Waiter, entry: Entry) -> None:
        super().__init__()
        self.hub = hub
        self.entry = entry
        self.event = threading.Event()
        self.future: Future[list[torch.Tensor]] | None = None
        self.future_lock = threading.Lock()

    def wait(self, timeout: object = None) -> bool:
        """Block until the op completed; raise its error (a ``TwinError``, or the group's
        timeout, or ``timeout`` here, as "timed out")."""
        self.hub.wait(self, seconds(timeout))
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self.event.is_set()

    def is_success(self) -> bool:
        return self.event.is_set() and self.entry.error is None

    def exception(self) -> BaseException | None:
        return self.entry.error if self.event.is_set() else None

    def result(self) -> list[torch.Tensor]:
        return self.entry.outputs()

    def get_future(self) -> Future[list[torch.Tensor]]:
        with self.future_lock:
            if self.future is None:
                self.future = Future()
                if self.event.is_set():
                    self._complete_future()
            return self.future

    def settle(self) -> None:
        """The entry finished (called outside the hub's lock: futures run callbacks)."""
        self.event.set()
        with self.future_lock:
            if self.future is not None:
                self._complete_future()

    def _complete_future(self) -> None:
        assert self.future is not None
        if self.future.done():
            return
        if self.entry.error is not None:
            self.future.set_exception(self.entry.error)
        else:
            self.future.set_result(self.entry.outputs())

    def __repr__(self) -> str:
        return f"TwinWork({self.entry.describe()}, {self.entry.state})"
