"""In-process hand-offs between stages ("local" transport), optionally one CUDA stream per stage.

Why a transport at all when everything is in one process: so the executor runs the same
SF/RF/SB/RB actions of the schedule IR as under gloo/NCCL, and so that on one GPU each stage
can run on its own CUDA stream with the hand-offs as the only synchronisation points.

CUDA streams, correct by construction:

* ``send`` records an event on the *sender's* stream right after the producing kernel was
  enqueued; ``recv`` makes the *receiver's* stream wait on that event before anything reads
  the tensor (an event, not a host sync: the CPU keeps enqueueing).
* The received tensor was allocated on the sender's stream; ``record_stream(receiver)`` tells
  the caching allocator not to reuse its memory until the receiver's pending work is done,
  even if the last Python reference dies earlier.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.runtime.transport.base import Transport

__all__ = ["LocalTransport"]


class LocalTransport(Transport):
    """Mailboxes keyed by (channel, sending stage, micro-batch); polling receives."""

    blocking = False
    name = "local"

    def __init__(self, streams: list[torch.cuda.Stream] | None = None) -> None:
        self.streams = streams
        self._box: dict[tuple[str, int, int], tuple[Any, Any]] = {}

    def send(self, channel: str, stage: int, mb: int, tensor: Any) -> None:
        event = None
        if self.streams is not None and isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            event = torch.cuda.Event()
            event.record(self.streams[stage])
        self._box[(channel, stage, mb)] = (tensor, event)

    def recv(self, channel: str, stage: int, mb: int, certain: int | None = None) -> Any | None:
        src = stage - 1 if channel == "act" else stage + 1
        item = self._box.pop((channel, src, mb), None)
        if item is None:
            return None
        tensor, event = item
        if event is not None and self.streams is not None:
            stream = self.streams[stage]
            stream.wait_event(event)
            tensor.record_stream(stream)
        return tensor

    def pending(self) -> int:
        """Messages sent but not received (0 after a complete step or flush)."""
        return len(self._box)

    def clear(self) -> None:
        self._box.clear()
