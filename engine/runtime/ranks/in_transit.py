"""Messages in transit at a step boundary: what a rank's neighbours sent and it has not
received yet, and what it holds to send.

Why a module: two things need them besides running the step. An asynchronous NCCL step ends
with every message its neighbours sent received (no NCCL operation stays pending across a
step boundary: transport/nccl.py says why), and the in-flight state of an unflushed pipeline
(:mod:`~engine.runtime.state.inflight`) saves them, so that a loaded rank starts with them
and the run does not change. :class:`InTransit` is that part of
:class:`~engine.runtime.ranks.lane.RankLane`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from engine.runtime.exec.program import RB, RF, SB, SF
from engine.runtime.exec.protocol import StepProtocol
from engine.runtime.stage import trees

__all__ = ["InTransit"]


class InTransit:
    """The in-transit messages of a :class:`~engine.runtime.ranks.lane.RankLane` (a base
    class of it: the lane's protocol, stage, transport and mailboxes are its state)."""

    p: StepProtocol
    s: int
    stage: Any
    transport: Any
    _early: dict[tuple[str, int], Any]
    _outbox: dict[tuple[str, int], Any]
    _out_flags: dict[tuple[int, int], Tensor]
    _flag_arrived: Callable[[Any, Any, int], None]
    _scale_arrived: Callable[[int, Any, int], None]

    def _in_transit(self, channel: str) -> list[int]:
        """Micro-batches whose ``channel`` message the neighbour sent in this segment's steps
        so far and this rank has not received (the schedule says: both run the same programs;
        a message is received within a few steps of its send, 4S+4 is ample)."""
        p = self.p
        s = self.s
        peer = s - 1 if channel == "act" else s + 1
        if not 0 <= peer < p.S:
            return []
        send, recv = (SF, RF) if channel == "act" else (SB, RB)
        sent: set[int] = set()
        got: set[int] = set()
        for jj in range(max(0, p.j - 4 * p.S - 4), p.j):
            prog, base = p.compiler.step(jj), jj * p.M
            sent.update(base + rel for op, rel in prog.stages[peer] if op == send)
            got.update(base + rel for op, rel in prog.stages[s] if op == recv)
        return sorted(sent - got)

    def _receive_in_transit(self) -> None:
        """Receive now what the neighbours sent in this segment's steps and this rank has not
        received, keeping it for its RF/RB op (the run does not change)."""
        tp = self.transport
        for channel in ("act", "grad"):
            for mb in self._in_transit(channel):
                if (channel, mb) not in self._early:  # (an earlier call received it)
                    value = tp.recv(channel, self.s, mb)
                    if channel == "grad" and self.p.flags is not None:
                        self._flag_arrived(self.stage, tp, mb)
                    if channel == "grad" and self.p.carry_scales:
                        self._scale_arrived(self.s, tp, mb)
                    # (kept even when None: a gradient whose only message was its flag was
                    # received, and its RB must not post a second receive for it)
                    self._early[(channel, mb)] = value

    def wire_state(self) -> dict[str, Any]:
        """Messages at a step boundary, for the in-flight state (:mod:`~engine.runtime.state.inflight`;
        every rank calls it at the same step): what the neighbours sent and this rank has not
        received is received now and kept for its RF/RB op (the run does not change), this
        rank's own sends are waited for (its neighbours receive them in their call), and the
        outbox holds what it will send. A rank loading the result starts with those."""
        tp = self.transport
        self._receive_in_transit()
        tp.wait_sends()
        mail = [("received", self._early), ("outbox", self._outbox)]
        # the shapes the gradients of activations in flight travel with (a resumed rank has
        # not seen those activations travel)
        out: dict[str, Any] = {"shapes": tp.wire_shapes()}
        for key, box in mail:
            out[key] = []
            for (c, mb), v in sorted(box.items()):
                value, flags = trees.detached_copy(v)  # a tensor, or a tree of them
                flag = self._out_flags.get((self.s, mb)) if key == "outbox" and c == "grad" else None
                out[key].append({"channel": c, "mb": mb, "value": value, "grad": flags,
                                 "flag": None if flag is None else flag.clone()})
        return out

    def load_wire_state(self, state: dict[str, Any]) -> None:
        """Undo :meth:`wire_state` in a fresh rank: early receives, the outbox, and the shapes
        of the activations in flight (older states have none: the agreed shapes then)."""
        self._out_flags.clear()
        self.transport.restore_wire_shapes(state.get("shapes", {}))
        for key, box in (("received", self._early), ("outbox", self._outbox)):
            box.clear()
            device = self.transport.device  # (saved tensors load on the CPU)
            for d in state[key]:
                value = trees.map_tensors(lambda t: t.to(device), d["value"])
                box[(d["channel"], d["mb"])] = trees.with_grad_flags(value, d["grad"])
                if d.get("flag") is not None:
                    self._out_flags[(self.s, d["mb"])] = d["flag"].to(self.transport.device)
