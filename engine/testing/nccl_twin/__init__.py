"""The NCCL twin: a ``torch.distributed`` backend that enforces NCCL's rules on CPU tensors.

Code written for NCCL can hang on a GPU cluster in ways gloo never shows: gloo buffers sends,
matches by tag and runs every op as soon as it is posted; NCCL does none of that. The twin
behaves like NCCL at its worst, on CPU, so a CPU CI run finds those hangs, and reports them.

Use::

    import engine.testing.nccl_twin  # registers the backend "nccl_twin" (once)
    dist.init_process_group("nccl_twin", timeout=datetime.timedelta(seconds=60))
    # or beside another default backend: dist.new_group(ranks, backend="nccl_twin")

Tensors are CPU tensors (the twin's "device"). ``dist.new_group(ranks)`` then makes twin groups
and ``dist.new_group(ranks, backend="gloo")`` real gloo groups beside them. All processes run
on one host (the twin listens on 127.0.0.1).

Rules it enforces
-----------------
* **Communicators as ProcessGroupNCCL makes them**: one per process group, for its collectives
  and its ``batch_isend_irecv`` lists; one per pair of ranks of a group (``"low:high"``) for
  its unbatched ``send``/``recv``/``isend``/``irecv``.
* **One in-order queue per communicator per rank**: an entry (one unbatched op, one
  ``batch_isend_irecv`` list, one collective) starts only when every earlier entry of that
  communicator on that rank completed. Communicators are independent of each other.
* **Tags are ignored**: point-to-point ops match by posting order per (communicator, sender,
  receiver). The two ends must agree on element count and dtype; otherwise both raise a
  :class:`MismatchError` naming both ranks, the communicator, the sequence number, both shapes
  and dtypes (NCCL would corrupt memory or hang).
* **No eager buffer**: a send completes only when the receiver's matching receive is running
  (at the head of its queue), and a receive when its send is running. The ops of one
  ``batch_isend_irecv`` list progress together; the list completes when all its ops do.
* **Collectives** queue behind their communicator's pending point-to-point entries and
  complete when every member runs them: ``all_reduce`` (SUM, AVG, MAX, MIN, PRODUCT, folded in
  group-rank order, so every rank and run gets the same bits), ``broadcast``, ``all_gather``,
  ``all_gather_into_tensor``, ``reduce_scatter`` (list and tensor forms), ``all_to_all``
  (both forms), ``reduce``, ``gather``, ``scatter``, ``barrier``, and so
  ``all_gather_object``/``broadcast_object_list`` and functional collectives (DTensor).
* **Dtypes as ProcessGroupNCCL**: ``int16`` and the other dtypes NCCL lacks raise its
  ``TypeError`` at the call; ``bool`` rides as ``uint8`` (a SUM of bools is a MAX), complex as its
  real view. Tensors must be contiguous CPU tensors.
* **Works**: ``wait()`` blocks until the op completed (the data dependence is real) or raises;
  ``is_completed()`` polls; ``exception()``, ``result()``, ``get_future()``; ``wait(timeout)``.
  A ``batch_isend_irecv`` list returns one work, as ProcessGroupNCCL's does. The group's
  timeout acts as NCCL's watchdog: a work not done within it fails with "timed out", and its
  communicator is aborted on that rank (every later op on it fails).
* **Deadlock report**: when no op anywhere in the job progressed for
  ``ENGINE_NCCL_TWIN_DEADLOCK_S`` seconds (default 10) while every rank waited in a twin wait,
  every waiting rank raises a :class:`DeadlockError` naming each rank's queue head on each
  communicator with pending entries: op, peer, group, sequence numbers, shape and dtype, and
  the label the poster set with :func:`engine.op_label.labelled`. A rank counts as waiting
  while one of its threads is inside a twin work's ``wait()`` (a rank that polls
  ``is_completed()``, or waits on gloo, counts as busy: only the timeout stops it).
* **A rank that leaves** (its process exits, or it destroys or aborts the group) fails the
  ops its peers still need at once with a :class:`PeerLeftError` naming it. ``pg.abort()`` and
  ``shutdown()`` fail the rank's own pending ops.

What it does not model
----------------------
NCCL's eager buffering of small messages (the twin never buffers: the worst case), CUDA
streams (``wait()`` blocks the host; there is no compute/communication overlap to get wrong),
communicator initialisation (a rendezvous of all members at a communicator's first op unless
the group was created eagerly), ``torch``'s ``_coalescing_manager`` (use
``dist.batch_isend_irecv``), ``PREMUL_SUM``, several hosts, and NCCL's own reduction order
(the twin's fold is rank-ordered; NCCL's ring or tree order differs in the last bits, as
gloo's does).

Why ``batch_isend_irecv`` is wrapped
------------------------------------
torch's ``dist.batch_isend_irecv`` coalesces a list into one NCCL group only for C++ process
groups (``type(group) is ProcessGroup``); for a Python group like the twin's it issues the
ops one by one, as unbatched ops. A list is exactly the unit whose ops must progress together,
so importing this module replaces ``torch.distributed.batch_isend_irecv`` (and
``torch.distributed.distributed_c10d.batch_isend_irecv``) with a version that posts the list as
one entry on a twin group's communicator and calls torch's own for any other group. Call it
as ``dist.batch_isend_irecv``: a reference bound before the import keeps torch's.

Environment
-----------
``ENGINE_NCCL_TWIN_DEADLOCK_S``: seconds without progress, with every rank waiting, before
the deadlock report (default 10; a waiting rank looks every ``min(0.5, limit / 5)`` s).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch.distributed as dist

from engine.testing.nccl_twin.errors import (
    DeadlockError,
    MismatchError,
    PeerLeftError,
    TwinError,
    TwinTimeoutError,
)
from engine.testing.nccl_twin.group import BACKEND, TwinProcessGroup
from engine.testing.nccl_twin.hub import Hub
from engine.testing.nccl_twin.work import TwinWork

__all__ = [
    "BACKEND",
    "DEADLOCK_ENV",
    "DeadlockError",
    "MismatchError",
    "PeerLeftError",
    "TwinError",
    "TwinProcessGroup",
    "TwinTimeoutError",
    "TwinWork",
    "batch_isend_irecv",
    "deadlock_seconds",
    "register",
]

DEADLOCK_ENV = "ENGINE_NCCL_TWIN_DEADLOCK_S"

_lock = threading.Lock()
_hub: Hub | None = None
#: torch's own (a reload of this module must not wrap the wrapper)
_torch_batch_isend_irecv = getattr(
    dist.distributed_c10d.batch_isend_irecv, "torch_original", dist.distributed_c10d.batch_isend_irecv
)


def deadlock_seconds() -> float:
    """The deadlock report's limit from ``ENGINE_NCCL_TWIN_DEADLOCK_S`` (default 10)."""
    raw = os.environ.get(DEADLOCK_ENV, "10")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{DEADLOCK_ENV} must be a positive number of seconds, got {raw!r}")
    return value


def _hub_for(store: dist.Store, rank: int) -> Hub:
    """This process's hub, made with its first twin group (and again after the last closed)."""
    global _hub
    with _lock:
        if _hub is None or _hub.closed:
            root = store
            while isinstance(root, dist.PrefixStore):
                root = root.underlying_store
            gen = root.add(f"nccl_twin/hubs/{rank}", 1) - 1  # same count on every rank
            _hub = Hub(root, rank, gen, deadlock_seconds())
        elif _hub.rank != rank:
            raise RuntimeError(f"NCCL twin: this process is rank {_hub.rank}, a group says {rank}")
        return _hub


def _create(opts: Any, backend_options: Any = None) -> TwinProcessGroup:
    ranks = tuple(opts.global_ranks_in_group) or tuple(range(opts.group_size))
    hub = _hub_for(opts.store, ranks[opts.group_rank])
    info = hub.register_group(str(opts.group_id), ranks, opts.timeout.total_seconds())
    return TwinProcessGroup(hub, info)


def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:
    """``torch.distributed.batch_isend_irecv``, posting a twin group's list as one NCCL group
    (one entry, one work); any other group goes to torch's own."""
    if isinstance(p2p_op_list, list) and p2p_op_list and all(
        isinstance(op, dist.P2POp) for op in p2p_op_list
    ):
        group = p2p_op_list[0].group
        if isinstance(group, TwinProcessGroup):
            if any(op.group is not group for op in p2p_op_list):
                raise ValueError("All ops need to use the same group.")
            return group.post_batch(p2p_op_list)  # type: ignore[return-value]
    return _torch_batch_isend_irecv(p2p_op_list)  # type: ignore[no-any-return]


batch_isend_irecv.torch_original = _torch_batch_isend_irecv  # type: ignore[attr-defined]


def register() -> None:
    """Register the ``nccl_twin`` backend and wrap ``batch_isend_irecv`` (idempotent; runs on
    import)."""
    with _lock:
        if BACKEND.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
        dist.batch_isend_irecv = batch_isend_irecv
        dist.distributed_c10d.batch_isend_irecv = batch_isend_irecv


register()
