"""Where an activation's 8-byte header travels under gloo: inside the message of its first
tensor leaf when that leaf is small, as a message of its own otherwise.

Why: every activation carries a header (0: the shapes of the previous one; n > 0: a new
Signature of n bytes follows; n < 0: an error from upstream), so that shapes may change
between micro-batches (see p2p.py). Sent alone, the header is one more gloo rendezvous per
activation, and for small activations that message costs as much as the data: a 4-rank step
of a small model (64 KiB activations) took 15-20 % longer with it (bench/README.md, "The cost
of variable shapes"). Inside the first leaf's message it costs nothing but a copy of that leaf
on the sender, which for a leaf of at most :data:`INLINE_BYTES` is cheaper than a message; a
larger leaf keeps the header apart, where one small message is negligible beside it.

Both ends decide from the Signature they agreed for the previous activation, so they always
agree on the layout. The receiver's buffer is ``[header, padded to 64 bytes | leaf bytes]``; the leaf is a view
of it (no copy). A change of shapes is announced with an 8-byte message in place of the
posted ``[header | leaf]``, which gloo accepts since it is shorter than the posted buffer;
the receiver reads the header at offset 0 whatever the length. NCCL needs equal sizes at both
ends, so it always sends the header alone (and receives it first).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.runtime.stage.trees import LeafMeta, Signature

__all__ = ["HEAD_BYTES", "INLINE_BYTES", "Posted", "inline", "frame", "head_message", "fills", "framed_buffer", "framed_buffers", "read_header"]

#: the header's room before the leaf: 8 bytes used, padded so that the leaf keeps the 64-byte
#: alignment of torch's CPU allocations (kernels pick vector paths by alignment, and a leaf at
#: offset 8 gave a different float32 result than the same leaf sent alone)
HEAD_BYTES = 64
#: a first leaf of at most this many bytes carries its activation's header (gloo)
INLINE_BYTES = 1 << 18


@dataclass
class Posted:
    """Receives posted for one micro-batch: their works, the buffers the tensors are read
    from, the Signature they were posted for, and (header inline) the framed buffer whose
    first bytes are the header (:func:`read_header`)."""

    works: list[Any]
    bufs: list[Tensor]
    sig: Signature
    head: Tensor | None = None


def _nbytes(meta: LeafMeta) -> int:
    return math.prod(meta.shape) * meta.dtype.itemsize


def inline(backend: str, sig: Signature | None) -> bool:
    """Whether activations of ``sig`` carry their header inside the first leaf's message."""
    if backend != "gloo" or sig is None:
        return False
    metas = sig.metas(False)
    return bool(metas) and _nbytes(metas[0][1]) <= INLINE_BYTES


#: the header of an activation with the previous one's shapes (n = 0), zero-padded
_HEAD_0 = torch.zeros(HEAD_BYTES, dtype=torch.uint8)


def frame(leaf: Tensor, n: int) -> Tensor:
    """``[header n | leaf's bytes]`` as one uint8 tensor (one copy of the leaf, ``leaf``
    contiguous). One ``cat``: a step sends this per activation, and the eight indexing ops
    it replaced cost ~13 us of host time against ~3 us (16 KiB leaf, CPU)."""
    head = _HEAD_0
    if n != 0:  # (no stale process memory on the wire: the padding is zeros)
        head = _HEAD_0.clone()
        head[:8].view(torch.int64)[0] = n
    return torch.cat((head, leaf.reshape(-1).view(torch.uint8)))


def framed_buffer(meta: LeafMeta, device: torch.device) -> tuple[Tensor, Tensor]:
    """A receive buffer for ``[header | leaf]``: (the buffer, the leaf's view; the header is
    :func:`read_header` of the buffer). Two tensor ops (``empty``, ``set_``) where slicing and
    viewing took five: a rank posts one per activation it receives."""
    raw = torch.empty(HEAD_BYTES + _nbytes(meta), dtype=torch.uint8, device=device)
    leaf = torch.empty(0, dtype=meta.dtype, device=device)
    leaf.set_(raw.untyped_storage(), HEAD_BYTES // meta.dtype.itemsize, meta.shape)
    return raw, leaf


def framed_buffers(
    metas: list[tuple[Any, LeafMeta]], device: torch.device
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """The receive of an activation framed with its header (``metas``: its leaves): (the
    leaves' tensors, the buffers to post, the framed buffer). Leaf 0 is a view of the framed
    buffer and gets no buffer of its own (one allocation of the leaf's size less per
    activation received)."""
    head, first = framed_buffer(metas[0][1], device)
    rest = [torch.empty(m.shape, dtype=m.dtype, device=device) for _, m in metas[1:]]
    return [first, *rest], [head, *rest], head


def read_header(raw: Tensor) -> int:
    """The header ``n`` of a received ``[header | leaf]`` buffer (on the CPU read straight
    from memory: one call per activation received)."""
    if raw.device.type == "cpu":
        return ctypes.c_int64.from_address(raw.data_ptr()).value
    return int(raw[:8].view(torch.int64)[0])


def head_message(n: int) -> Tensor:
    """The header alone, as the 8 bytes that complete a posted ``[header | leaf]`` receive."""
    return torch.tensor([n], dtype=torch.int64).view(torch.uint8)


def fills(sig: Signature) -> list[Tensor]:
    """At most one byte per tensor leaf of ``sig``: completes the receives posted for those
    shapes (gloo takes a message shorter than the posted buffer)."""
    return [torch.zeros(min(1, math.prod(m.shape)), dtype=torch.uint8) for _, m in sig.metas(False)]
