"""The interface every multi-process transport implements: move one activation or gradient.

Why one small interface: a rank runs its stage's list of the compiled step programs
(:mod:`engine.runtime.exec.program`) whatever carries the tensors. ``SF(n)`` becomes
``send("act", s, n, y)``, ``RF(n)`` becomes ``recv("act", s, n)``, ``SB``/``RB`` the same on
the ``"grad"`` channel. Channels are FIFO per (channel, sender): a stream sends and receives
in micro-batch order, so transports may match messages by order. ``recv`` blocks until the
peer's message arrives, at most ``timeout`` seconds, and raises :class:`PeerError` naming the
peer when it died or hangs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from engine.errors import PeerError, ShapeAgreementError

__all__ = ["Transport", "PeerError", "ShapeAgreementError", "CHANNELS", "DTYPES", "NCCL_DTYPES"]

#: "act": stage s -> s+1 (forward activations); "grad": stage s -> s-1 (input gradients)
CHANNELS = ("act", "grad")
#: what the multi-process transports carry
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
#: what NCCL carries (ProcessGroupNCCL has no 16-bit integer type; bool travels as uint8)
NCCL_DTYPES: tuple[torch.dtype, ...] = tuple(d for d in DTYPES if d is not torch.int16)


class Transport(ABC):
    """Moves tensors between neighbouring stages; see the module docstring."""

    #: ``recv`` blocks until the message arrives (one stage per process)
    blocking: bool = True
    name: str = "?"

    @abstractmethod
    def send(
        self, channel: str, stage: int, mb: int, tensor: Any, flag: Tensor | None = None
    ) -> None:
        """Send ``tensor`` from ``stage`` on ``channel`` (asynchronously where possible);
        ``flag``: the micro-batch's non-finite flag, which a gradient carries where the
        transport's ``flags`` is set (on_nonfinite="skip_update")."""

    @abstractmethod
    def recv(self, channel: str, stage: int, mb: int, certain: int | None = None) -> Any | None:
        """The tensor ``stage`` receives on ``channel`` for micro-batch ``mb``. ``certain``:
        every micro-batch below it will be received on this channel in the current call, so a
        transport may post those receives ahead."""

    def release(self, channel: str, mbs: list[int]) -> None:  # noqa: B027 - optional hook
        """Forget the sends of micro-batches ``mbs`` on ``channel``: the caller knows from the
        schedule that the peer has received and consumed them (blocking transports)."""

    def wait_sends(self) -> None:  # noqa: B027 - optional hook
        """Block until every send issued so far has left (their buffers may then be reused)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release communication resources."""

    @staticmethod
    def describe(tensor: Tensor | None) -> str:
        if tensor is None:
            return "None"
        return f"{tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}"
