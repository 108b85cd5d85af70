"""Transports: how activations and gradients travel between stages in different processes.

``gloo`` (one process per stage, CPU tensors) and ``nccl`` (one process per stage and GPU)
run each rank's list of the compiled step programs through the :class:`Transport`
interface; ``layout`` maps processes to (replica, stage) and builds the process groups,
which ``groups`` creates (the engine's own, their gloo network thread under SCHED_BATCH);
``abort`` holds the frames a rank sends in place of what it owes when its step aborts;
``trailers`` the 1-element messages that ride behind a gradient (flag, loss scale);
``shm`` the shared-memory rings that carry a gloo pipeline's messages between neighbours on
one host (futex wake-ups instead of gloo's TCP loopback and loop thread). In
one process there is no transport: the executor hands tensors between stages directly (with
CUDA events between per-stage streams, see ``engine.runtime.exec.streams``).
"""

from __future__ import annotations

from engine.runtime.dist.transport.base import CHANNELS, PeerError, ShapeAgreementError, Transport
from engine.runtime.dist.transport.layout import Layout, init_distributed, make_layout
from engine.runtime.dist.transport.p2p import P2PTransport

__all__ = [
    "CHANNELS",
    "Layout",
    "P2PTransport",
    "PeerError",
    "ShapeAgreementError",
    "Transport",
    "init_distributed",
    "make_layout",
]
