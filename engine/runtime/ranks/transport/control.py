"""The control plane: the host messages of a multi-process pipeline, always on gloo.

Why a plane of its own: NCCL carries device tensors only, runs the operations of each
communicator strictly in posting order, and a send may block until its receive runs. What a
rank reads on the host -- shapes and pickled Signatures, the step's loss and verdict, the
per-step shape notices, tensor-parallel placements, configuration fingerprints, checkpoint
statuses, trace events -- would each cost a device copy and a device synchronisation there,
and a collective whose result the host reads, queued on a communicator behind an
asynchronous step's sends whose receives only come next step, would wait forever. So every
host message travels on gloo: under ``transport="gloo"`` on the pipeline's own group (and
its shared-memory rings, shm.py), under ``transport="nccl"`` on a gloo group of the
pipeline's ranks created beside the NCCL groups (layout.py), and the job-wide exchanges on
one gloo group of the whole world (:func:`world_group`). NCCL then carries only what lives on
the device: activations, gradients and their trailers, and the device collectives
(gradient all-reduce, clipping norms, loss-scale flags, tied gradients, tensor parallelism).

gloo matches a message by (group, peer, tag) in posting order, so each kind of message on a
pipeline's control group has a tag of its own (:data:`TAGS`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "TAGS", "LOSS_TAG", "HEADER_TAG", "META_TAG", "SHAPE_TAG", "NOTICE_TAG", "PLACEMENT_TAG",
    "HANDSHAKE_TAG", "world_group", "forget_world_group", "all_gather_bytes",
]

#: the step's loss and verdict (both transports)
LOSS_TAG = 7
#: gloo data path: the per-activation header and a new Signature (gloo.py)
HEADER_TAG, META_TAG = 8, 9
#: NCCL: the header of an activation whose shapes may have changed, and its Signature (nccl.py)
SHAPE_TAG = 10
#: NCCL: the first stage's per-step notice of micro-batches with new input shapes
NOTICE_TAG = 11
#: tensor parallelism: the output placements a stage announces at the handshake
PLACEMENT_TAG = 12
#: NCCL: the handshake's Signatures (under gloo they ride on tag 0 before any data)
HANDSHAKE_TAG = 13
TAGS = {
    "loss": LOSS_TAG, "header": HEADER_TAG, "meta": META_TAG, "shape": SHAPE_TAG,
    "notice": NOTICE_TAG, "placement": PLACEMENT_TAG, "handshake": HANDSHAKE_TAG,
}

#: the job-wide gloo groups made for a default group of another backend, per timeout:
#: (default group, {timeout: group})
_WORLD: list[Any] = []


def world_group(timeout: float | None = None) -> Any:
    """The gloo group of every rank for job-wide host exchanges: None (the default group)
    when the default group is gloo, else a gloo group of the world with ``timeout`` seconds
    (None: torch's default), made on the first call with that timeout.

    Why one per timeout: a blocking collective waits as long as its group's timeout, so the
    exchanges of a pipeline must run on a group with that pipeline's timeout, not on the one
    an earlier pipeline of the process (say, one with a short timeout) made. Collective on a
    first call (``new_group`` is): every rank reaches its job-wide exchanges at the same
    points of the program (building a pipeline, its steps, saving, tracing) with the same
    pipeline settings (agreed at the build), so they create each group together."""
    if dist.get_backend() == "gloo":
        return None
    default = dist.distributed_c10d._get_default_group()
    if not _WORLD or _WORLD[0] is not default:
        _WORLD[:] = [default, {}]
    made: dict[float | None, Any] = _WORLD[1]
    if timeout not in made:
        from engine.runtime.ranks.transport.groups import new_group

        made[timeout] = new_group(list(range(dist.get_world_size())), backend="gloo", timeout=timeout)
    return made[timeout]


def forget_world_group() -> None:
    """Drop the job-wide gloo groups (teardown: no reference may keep their threads alive)."""
    _WORLD.clear()


def all_gather_bytes(data: bytes, group: Any) -> list[bytes]:
    """Every rank's ``data`` (any length) on every rank of ``group`` (a gloo group; None: the
    default group), as plain bytes over two gloo all_gathers: no pickle."""
    n = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    chunks = [torch.zeros_like(padded) for _ in range(n)]
    dist.all_gather(chunks, padded, group=group)
    return [c[: int(k)].numpy().tobytes() for c, k in zip(chunks, sizes, strict=True)]
