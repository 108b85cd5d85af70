"""A clean end for the processes of a multi-process pipeline.

Why: a process that exits without tearing its gloo group down leaves that group's C++ state
(worker threads, the TCP transport's loop thread, communication still pending) to be torn
apart by the interpreter's finalization and by C++ static destructors, in no defined order,
while the neighbours exit too and close their sockets under it. That sometimes ended in
``terminate called without an active exception`` (SIGABRT, exit code 134) after a run that
had completed -- e.g. right after an unflushed ``engine.save``, where an asynchronous
pipeline is left with its last loss messages sent and never waited for -- so torchrun
reported a failed job and ``--max-restarts`` paid a restart.

So at interpreter exit (``atexit``: before finalization, while every object is alive), each
live transport of this process completes or cancels what it still has in flight (sends: a
short wait, since the peer already received them in every flow the engine runs; receives
posted ahead are left to the group's destruction) and drops its references to its groups;
then, if the engine created the default process group
(:func:`~engine.runtime.ranks.transport.layout.init_distributed`), it releases the copy that
``torch.distributed.nn.functional`` captured (:func:`release_captured_world`) and destroys
it. With no reference left the group's C++ object dies right there: the gloo threads are
joined on the main thread while the interpreter is still whole (checked by
tests/runtime/ranks/test_clean_exit.py: no gloo or store thread is left after the teardown). A group the
user created stays theirs to destroy; its pending work is still settled. Without
torchrun's agent rank 0 also waits (bounded) for the other ranks to reach their exit, since
its process hosts the store they read the first failure from (:func:`exit_rendezvous`).
"""

from __future__ import annotations

import atexit
import datetime
import os
import time
import weakref
from typing import Any

import torch.distributed as dist

from engine.runtime.ranks.first_failure import _store

__all__ = ["track", "created_default_group", "teardown"]

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_STATE: dict[str, Any] = {"registered": False, "created": False}
#: how long a send may still take at exit before it is abandoned (its peer already received
#: it in every flow the engine runs: this is a bound, not an expected wait)
EXIT_WAIT = datetime.timedelta(seconds=5)
#: how long rank 0 (the store's host without torchrun's agent) waits at exit for the others
LINGER = 10.0


def track(owner: Any) -> None:
    """Settle ``owner``'s communication at exit (it has ``settle_for_exit()``)."""
    _LIVE.add(owner)
    if not _STATE["registered"]:
        atexit.register(teardown)
        _STATE["registered"] = True


def created_default_group() -> None:
    """The engine initialised the default process group: it destroys it at exit."""
    _STATE["created"] = True
    if not _STATE["registered"]:
        atexit.register(teardown)
        _STATE["registered"] = True


def settle(works: list[Any]) -> None:
    """Wait briefly for sends (:data:`EXIT_WAIT` in all, per process); never raise (a peer
    may be gone at exit). Receives posted ahead cannot be cancelled from Python (gloo's Work
    has no abort there); destroying the group with them pending returns at once and cleanly
    (checked with torch 2.13)."""
    deadline = _STATE.setdefault("deadline", time.monotonic() + EXIT_WAIT.total_seconds())
    for work in works:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            work.wait(datetime.timedelta(seconds=left))
        except Exception:  # noqa: BLE001 -- exit path: nothing to report to, nothing to fix
            pass


def exit_rendezvous() -> None:
    """Without torchrun's agent the job's store lives in rank 0's process, and the other
    ranks read the first-failure note from it while they raise (first_failure.py): rank 0
    exiting first would make them blame it. So every other rank checks in at its teardown
    and rank 0 waits for them, at most :data:`LINGER` seconds (a rank killed outright never
    checks in)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return  # the agent hosts the store; it outlives the workers
    store = _store()
    if store is None:
        return
    key = f"engine/exited/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        if dist.get_rank() != 0:
            store.add(key, 1)
            return
        others, deadline = dist.get_world_size() - 1, time.monotonic() + LINGER
        while store.add(key, 0) < others and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 -- exit path: the store may be gone already
        pass


def release_captured_world() -> None:
    """Drop the default group from ``torch.distributed.nn.functional``'s default arguments.

    Why: that module's functions are defined as ``def broadcast(tensor, src,
    group=group.WORLD)``, so a process that imports it after the default group exists (here:
    ``torch.optim``'s first ``add_param_group`` pulls it in through ``torch.distributed._shard``
    while the engine builds each stage's optimizer) keeps the live ``ProcessGroup`` in ten
    functions' ``__defaults__`` for good. ``destroy_process_group`` then frees nothing: the
    gloo group's two work loops, its TCP loop and rank 0's store daemon keep running past the
    teardown and are torn down by the interpreter's finalization or by ``exit()`` -- the
    unordered end this module exists to prevent (seen: all four threads alive after the
    teardown on every rank; the ten defaults were exactly the group's missing references)."""
    try:  # imported before the group by init_distributed, so normally bound to None already
        from torch.distributed.nn import functional as mod
    except Exception:  # noqa: BLE001 -- exit path: a torch without it captured nothing
        return
    world = getattr(dist.GroupMember, "WORLD", None) if dist.is_available() else None
    if world is None:
        return
    for fn in list(vars(mod).values()):
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(d is world for d in defaults):
            fn.__defaults__ = tuple(None if d is world else d for d in defaults)


def teardown() -> None:
    """Settle every tracked transport, meet at the exit (:func:`exit_rendezvous`), then
    destroy the default group if the engine made it."""
    for owner in list(_LIVE):
        try:
            owner.settle_for_exit()
        except Exception:  # noqa: BLE001 -- exit path
            pass
    _LIVE.clear()
    exit_rendezvous()
    from engine.runtime.ranks.transport.control import forget_world_group

    forget_world_group()  # (the NCCL job's gloo control group: no reference may outlive it)
    if _STATE["created"] and dist.is_available() and dist.is_initialized():
        try:
            release_captured_world()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 -- exit path
            pass
        _STATE["created"] = False
