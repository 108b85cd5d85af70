"""Transports: how activations and gradients travel between stages in different processes.

Two transports behind one interface (:class:`Transport`; what they share: ``p2p``):
``gloo`` (``gloo.GlooTransport``: one process per stage, CPU tensors) and ``nccl``
(``nccl.NCCLTransport``: one process per stage and GPU, built against NCCL's ordering rules).
``layout`` maps processes to (replica, stage) and builds the process groups, which ``groups``
creates (the engine's own, their gloo network thread under SCHED_BATCH); ``control`` is the
control plane, the gloo groups that carry every host message under both transports;
``shape_notice`` the first stage's per-step notices under NCCL; ``handshake`` the first
step's shape agreement; ``abort`` the frames a gloo rank sends in place of what it owes when
its step aborts; ``trailers`` the 1-element messages that ride behind a gradient (flag, loss
scale); ``shm`` the shared-memory rings that carry a gloo pipeline's messages between
neighbours on one host (futex wake-ups instead of gloo's TCP loopback and loop thread). In
one process there is no transport: the executor hands tensors between stages directly (with
CUDA events between per-stage streams, see ``engine.runtime.exec.streams``).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.runtime.ranks.transport.base import CHANNELS, PeerError, ShapeAgreementError, Transport
from engine.runtime.ranks.transport.gloo import GlooTransport
from engine.runtime.ranks.transport.layout import Layout, init_distributed, make_layout
from engine.runtime.ranks.transport.nccl import NCCLTransport
from engine.runtime.ranks.transport.p2p import P2PTransport

__all__ = [
    "CHANNELS",
    "GlooTransport",
    "Layout",
    "NCCLTransport",
    "P2PTransport",
    "make_transport",
    "PeerError",
    "ShapeAgreementError",
    "Transport",
    "init_distributed",
    "make_layout",
]


def make_transport(
    backend: str, stage: int, ranks: list[int], groups: Any, device: torch.device, timeout: float,
    control: Any = None,
) -> P2PTransport:
    """The transport of ``backend`` ("gloo" or "nccl") for ``stage``. ``groups``: the gloo
    pipeline group, or NCCL's channel groups (layout.ChannelGroups); ``control``: the
    control plane's calls (NCCL)."""
    if backend == "gloo":
        return GlooTransport(stage, ranks, groups, device, timeout)
    if backend == "nccl":
        return NCCLTransport(stage, ranks, groups, control, device, timeout)
    raise ValueError(f"backend={backend!r}; use 'gloo' (CPU) or 'nccl' (GPU)")
