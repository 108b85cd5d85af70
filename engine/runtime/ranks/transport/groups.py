"""The process groups the engine creates for its pipelines, and how their gloo network threads
are scheduled.

Why groups of its own: a pipeline's point-to-point messages, its loss/verdict messages and
its agreement collectives run on groups the engine creates (one pipeline group per replica,
one data-parallel group per stage, one group per boundary of virtual stages), never on the
default group the user may also use -- gloo matches messages by (peer, tag) in posting order,
so a user's own ``dist.recv`` on the default group could otherwise take a pipeline's
activation. Every rank creates every group, in the same order (``new_group`` is collective
over the world), so the callers iterate identically on every rank. A group handed in through
``mesh=`` stays the user's and is used as it is; so does the default group of a one-replica
NCCL pipeline (each NCCL group holds a communicator's device memory).

Why SCHED_BATCH for their gloo network thread (Linux): gloo's TCP transport runs one loop
thread per group that reads every incoming message and wakes the waiting thread. When a peer
writes, that loop thread wakes -- and under the default policy the scheduler lets a waking
thread preempt the running one, typically a stage's main thread in the middle of posting a
send on the same connection, holding that connection's lock. The loop thread then finds the
lock taken (gloo's handler only try-locks) and spins on ``epoll_wait`` until the main thread
runs again, thousands of extra ``epoll_wait`` calls per step where ranks share cores.
SCHED_BATCH (``sched(7)``) is the policy for threads that should not preempt on wakeup; the
loop thread still runs as soon as a core is free or the running thread blocks, which in a
pipeline is within the step's next wait. The measurements, with and without it:
bench/README.md, "gloo's network thread". On a machine with a free core per thread a waking
thread finds an idle core, so the policy should change little there. Set ``ENGINE_GLOO_BATCH=0`` to keep the default policy.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GroupCalls", "new_group", "batch_network_threads", "network_threads"]

#: the name gloo gives its TCP transport's loop thread (one per process group)
LOOP_THREAD = "gloo_tcp_loop"


def _threads() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: no thread list, nothing to tune
        return set()


def network_threads(tids: set[int] | None = None) -> list[int]:
    """The gloo network (TCP loop) threads among ``tids`` (default: all of this process's)."""
    out = []
    for t in sorted(_threads() if tids is None else tids):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                if f.read().strip().startswith(LOOP_THREAD):
                    out.append(t)
        except OSError:  # the thread ended meanwhile
            continue
    return out


def batch_network_threads(tids: set[int] | None = None) -> int:
    """Put the gloo network threads among ``tids`` under SCHED_BATCH (module docstring);
    returns how many. Never raises: where the policy or the thread list is unavailable the
    threads keep the default policy (only speed is at stake)."""
    if os.environ.get("ENGINE_GLOO_BATCH", "1").strip() == "0" or not hasattr(os, "SCHED_BATCH"):
        return 0
    done = 0
    for t in network_threads(tids):
        try:
            os.sched_setscheduler(t, os.SCHED_BATCH, os.sched_param(0))
            done += 1
        except OSError:  # (a sandbox refusing the call, a thread that ended)
            continue
    return done


def new_group(ranks: list[int], backend: str | None = None, timeout: float | None = None) -> Any:
    """``dist.new_group(ranks, backend=backend)`` (collective over the world; None: the
    default group's backend), its gloo network thread under SCHED_BATCH on the ranks it
    connects (module docstring). ``timeout``: the group's own (seconds; NCCL's watchdog
    counts it from each operation's enqueue). Without one torch gives a new group its
    backend's default (10 or 30 minutes), not the default group's."""
    before = _threads()
    td = None if timeout is None else datetime.timedelta(seconds=timeout)
    group = dist.new_group(list(ranks), backend=backend, timeout=td)
    batch_network_threads(_threads() - before)
    return group


class GroupCalls:
    """``dist.isend`` / ``dist.irecv`` on one gloo group as the group's own calls.

    Why: torch's wrappers resolve the group and the peer's rank in it on every call (up to
    ~5 us of host time a call: a 2-rank ping-pong took 33.6-44.0 us of CPU per round trip
    through them, 32.1-32.8 us through the group), and a pipeline posts two messages per
    micro-batch and stage; here both are resolved once per peer. Peers are global ranks, as
    for the wrappers."""

    def __init__(self, group: Any) -> None:
        self.group = group  # None: the default group
        self._pg: Any = None
        self._rank_in: dict[int, int] = {}
        self._forgotten = False

    def _in_group(self, rank: int) -> int:
        got = self._rank_in.get(rank)
        if got is None:
            if self._forgotten:  # (not the default group in its place)
                raise RuntimeError("this transport's process group was released at exit")
            if self._pg is None:
                self._pg = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
            got = self._rank_in[rank] = dist.get_group_rank(self._pg, rank)
        return got

    def send(self, t: Tensor, peer: int, tag: int) -> Any:
        dst = self._in_group(peer)  # (first: it resolves the group)
        return self._pg.send([torch.view_as_real(t) if t.is_complex() else t], dst, tag)

    def recv(self, buf: Tensor, src: int, tag: int) -> Any:
        src = self._in_group(src)
        return self._pg.recv([torch.view_as_real(buf) if buf.is_complex() else buf], src, tag)

    def forget(self) -> None:
        """Drop every reference to the group (the transport's teardown)."""
        self.group = self._pg = None
        self._rank_in.clear()
        self._forgotten = True
