"""What rides behind a micro-batch's gradient between ranks: one 1-element float32 message
each, after the gradient's leaves and in this order.

* The non-finite flag (``on_nonfinite="skip_update"``, :attr:`P2PTransport.flags`): it travels
  from the last stage to the first with the gradient and never through the host
  (engine/runtime/stage/device_flags.py); a clean micro-batch sends 0.
* The loss scale the gradient was computed under (asynchronous float16,
  :attr:`P2PTransport.scales`; engine/runtime/precision.py).

Why a module of its own: the sender appends them, the receiver posts buffers for them and
takes them off before the gradient is rebuilt, so the three places must agree on count and
order; here they cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["with_trailers", "trailer_buffers", "take_trailers"]


def with_trailers(
    tensors: list[Tensor], tp: Any, flag: Tensor | None, scale: Tensor | None
) -> list[Tensor]:
    """``tensors`` (a gradient's leaves) followed by the trailers ``tp`` sends."""
    out = list(tensors)
    if tp.flags:  # (flag None: a clean micro-batch)
        out.append(torch.zeros(1, dtype=torch.float32, device=tp.device) if flag is None
                   else flag.reshape(1).float())
    if tp.scales:  # (the stage's backward set it: precision.py)
        if scale is None:
            raise ValueError("a gradient of an asynchronous float16 step has no loss scale")
        out.append(scale.reshape(1).float())
    return out


def trailer_buffers(tp: Any) -> list[Tensor]:
    """Receive buffers for the trailers ``tp`` expects behind a gradient."""
    return [torch.empty(1, dtype=torch.float32, device=tp.device) for on in (tp.flags, tp.scales) if on]


def take_trailers(bufs: list[Tensor], mb: int, tp: Any) -> list[Tensor]:
    """The gradient's own buffers; the trailers wait in ``tp.arrived_flags`` /
    ``tp.arrived_scales`` under micro-batch ``mb``."""
    if tp.scales:
        tp.arrived_scales[mb] = bufs[-1]
        bufs = bufs[:-1]
    if tp.flags:
        tp.arrived_flags[mb] = bufs[-1]
        bufs = bufs[:-1]
    return bufs
