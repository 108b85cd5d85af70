"""Transports: how activations and gradients travel between stages.

``local`` (every stage in this process; optionally one CUDA stream per stage), ``gloo``
(one process per stage, CPU tensors) and ``nccl`` (one process per stage and GPU). All run
the same schedule IR actions through the :class:`Transport` interface; ``layout`` maps
processes to (replica, stage) and builds the process groups.
"""

from __future__ import annotations

from engine.runtime.transport.base import CHANNELS, PeerError, ShapeAgreementError, Transport
from engine.runtime.transport.layout import Layout, init_distributed, make_layout
from engine.runtime.transport.local import LocalTransport
from engine.runtime.transport.p2p import P2PTransport

__all__ = [
    "CHANNELS",
    "Layout",
    "LocalTransport",
    "P2PTransport",
    "PeerError",
    "ShapeAgreementError",
    "Transport",
    "init_distributed",
    "make_layout",
]
