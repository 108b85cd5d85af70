"""Abort frames: how a rank that cannot finish a step tells its neighbours (gloo).

Why: when the user's stage raises on one rank in the middle of a step, its peers block in
receives for tensors that will never come. Instead the failing rank runs the rest of its
step's sends and receives (engine/runtime/ranks/rank.py), sending an *abort frame* in place of each
message it owes; a peer whose receive gets one stops computing, and does the same. Every
message of the step is still sent and received, in the same order, so no rank is left
waiting and the transport's bookkeeping (receives posted ahead, sends held) stays in step.

* An activation's abort frame is an error header (n < 0, the path an input a stage refused
  already takes; p2p.py) whose body starts with :data:`MARK`, followed by the error's text.
* An asynchronous step does not abort: the failing rank drops the micro-batch, as the local
  run does, and sends a *dropped frame* in its place (the same two shapes, another mark or
  payload); its receivers drop it too and the step goes on.
* A gradient has no header (one message per leaf, and adding one would cost a gloo
  rendezvous per micro-batch), so its abort frame is a gradient of the agreed shapes whose
  first element is a *signalling NaN* with a fixed payload (:data:`PATTERNS`): arithmetic
  never produces a signalling NaN (IEEE 754 quiets them), so no computed gradient starts with
  one. Reading it back is one element on the CPU: gloo only (under NCCL the check would be a
  device synchronisation per gradient, so an exception inside a stage stays terminal there).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from engine.runtime.stage.trees import Signature

__all__ = ["MARK", "DROP_MARK", "PATTERNS", "DROP_PATTERNS", "Aborted", "Dropped", "AbortFrames", "frame_kind", "is_abort"]

#: the start of an activation abort frame's body (a refused input's text never starts so)
MARK = b"\x00engine-abort\x00"
#: the body of a *dropped* frame: an asynchronous step dropped this micro-batch (the failing
#: rank's forward or backward raised), its receivers drop it too and go on
DROP_MARK = b"\x00engine-dropped\x00"

#: per floating dtype: (integer dtype of the same width, the bits of its signalling NaN)
PATTERNS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.int32, 0x7FA5A5A5),
    torch.float64: (torch.int64, 0x7FF4A5A5A5A5A5A5),
    torch.float16: (torch.int16, 0x7D5A),
    torch.bfloat16: (torch.int16, 0x7FA5),
}


#: a dropped gradient's first element: the same signalling NaNs with another payload
DROP_PATTERNS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.int32, 0x7FA5A5A6),
    torch.float64: (torch.int64, 0x7FF4A5A5A5A5A5A6),
    torch.float16: (torch.int16, 0x7D5B),
    torch.bfloat16: (torch.int16, 0x7FA6),
}


class Dropped(Exception):
    """A receive got a dropped frame: the sender dropped this micro-batch (asynchronous)."""


class Aborted(Exception):
    """A receive got an abort frame: a peer could not finish this step (``text``: its error
    when the frame carried one)."""

    def __init__(self, text: str = "") -> None:
        super().__init__(text or "a peer rank aborted the step")
        self.text = text


def _marked(
    meta_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, table: dict[Any, Any]
) -> Tensor:
    t = torch.zeros(meta_shape, dtype=dtype, device=device)
    if t.numel() and dtype in table:
        bits, value = table[dtype]
        t.view(-1)[:1].view(bits).fill_(value)
    return t


#: the integer type of each pattern's width, to read a received buffer's first element
_CTYPES: dict[torch.dtype, Any] = {
    torch.int16: ctypes.c_int16, torch.int32: ctypes.c_int32, torch.int64: ctypes.c_int64,
}


def frame_kind(t: Tensor) -> str:
    """What a received gradient message is: "abort", "dropped" or "" (a gradient).

    The first element's bits are read straight from the CPU buffer (``data_ptr``: the first
    element even of a view): a receiving rank calls this once per gradient, and the four
    tensor ops of indexing cost ~60 us there with 4 ranks on 2 cores against ~2 us."""
    if t.dtype not in PATTERNS or t.numel() == 0 or t.device.type != "cpu":
        return ""
    bits, value = PATTERNS[t.dtype]
    got = _CTYPES[bits].from_address(t.data_ptr()).value
    if got == value:
        return "abort"
    return "dropped" if got == DROP_PATTERNS[t.dtype][1] else ""


def is_abort(t: Tensor) -> bool:
    """Whether a received gradient message is an abort frame (its first element the pattern)."""
    return frame_kind(t) == "abort"


class AbortFrames:
    """Mixin of :class:`~engine.runtime.ranks.transport.p2p.P2PTransport`: sending abort frames."""

    backend: str
    device: torch.device
    meta: dict[tuple[str, str], Signature]
    _recv_sigs: dict[int, Signature]
    _sends: dict[tuple[str, int], tuple[list[Any], list[Tensor], str]]
    flags: bool

    def send_abort(self, channel: str, stage: int, mb: int, text: str, dropped: bool = False) -> None:
        """An abort frame (``dropped``: a dropped frame) in place of micro-batch ``mb``'s
        message on ``channel`` (not waited for: the step's end waits for every send)."""
        if channel == "grad":
            table = DROP_PATTERNS if dropped else PATTERNS
            agreed = self._recv_sigs.get(mb, self.meta[("grad", "send")])
            grads = [_marked(m.shape, m.dtype, self.device, table) for _, m in agreed.metas(True)]
            flag = _marked((1,), torch.float32, self.device, table) if self.flags else None
            self.send("grad", stage, mb, grads, flag)  # type: ignore[attr-defined]
            return
        body = (DROP_MARK if dropped else MARK) + text.encode()[:2000]
        ts, tags = self._announce(self.meta.get(("act", "send")), -len(body), body)  # type: ignore[attr-defined]
        works = self._isend(ts, tags, self.ranks[stage + 1])  # type: ignore[attr-defined]
        earlier = self._sends.pop(("act", mb), None)
        if earlier is not None:
            self._wait_all(earlier[0], earlier[2])  # type: ignore[attr-defined]
        self._sends[("act", mb)] = (works, ts, f"sending the abort frame of micro-batch {mb}")
