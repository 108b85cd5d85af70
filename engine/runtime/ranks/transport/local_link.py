"""The boundary between two neighbouring stages that one rank holds: a hand-over in process.

Why: a placement such as the V (rank r holds stages r and 2R-1-r) puts stages R-1 and R on
the same rank, and contiguous blocks put many neighbours together. A process cannot send to
itself through gloo/NCCL point-to-point, and nothing has to travel: the rank runs both
stages' actions one at a time in the schedule's rank order, where the send of micro-batch m
(``SF``/``SB``) comes before its receive (the validator checks exactly that execution), so
the value can be left in a box and taken out.

What is handed over is what the single-process executor hands over: the producing stage's
output with its graph (the consuming stage detaches it, and a leaf's requires_grad says
whether a gradient comes back) and the input gradient as the stage's backward returned it.
So the two stages compute exactly what they compute in one process, bit for bit.

The two ends (:class:`LocalEnd`) stand in for the two :class:`P2PTransport` sides of the
boundary inside :class:`~engine.runtime.ranks.virtual.VirtualStageTransport`: the same calls
(send/recv, the handshake's send_meta/recv_meta, poison, the shape acceptance check), so the
rank's runtime does not know which boundaries cross processes. An error passed down the
pipeline in place of an activation (a shape a stage cannot take) is left in the box too and
raised, and passed on, by the receiving stage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.errors import PeerError, PipelineInputError
from engine.runtime.ranks.transport.p2p import P2PTransport
from engine.runtime.stage.trees import Signature

__all__ = ["LocalLink", "LocalEnd"]


class LocalLink:
    """The box between stage ``boundary`` (its :attr:`down` end) and ``boundary + 1`` (its
    :attr:`up` end), both on this rank."""

    def __init__(
        self, boundary: int, ranks: list[int], device: torch.device, timeout: float, backend: str
    ) -> None:
        #: (channel, micro-batch) -> (value, non-finite flag)
        self.box: dict[tuple[str, int], tuple[Any, Tensor | None]] = {}
        self.signature: Signature | None = None  # the handshake's announcement (None: failed)
        self.announced = False
        self.error: str | None = None  # passed down in place of the next activation
        self.down = LocalEnd(self, boundary, ranks, device, timeout, backend)
        self.up = LocalEnd(self, boundary + 1, ranks, device, timeout, backend)


class LocalEnd:
    """One stage's side of a :class:`LocalLink` (the P2PTransport calls the runtime makes)."""

    blocking = True
    peer_error = P2PTransport.peer_error

    def wait(self, work: Any, what: str, peer: int | None = None) -> None:
        """A collective the rank's runtime waits on through a stage's side: under NCCL the
        caller's stream waits (no host wait), under gloo the host, at most ``timeout``."""
        try:
            if self.backend == "nccl":
                work.wait()
            else:
                work.wait(self._td)
        except Exception as exc:
            raise self.peer_error(exc, what, peer) from exc

    def wait_host(self, work: Any, what: str, peer: int | None = None) -> None:
        """A control-plane (gloo) work, waited for on the host, at most ``timeout``."""
        try:
            work.wait(self._td)
        except Exception as exc:
            raise self.peer_error(exc, what, peer) from exc

    def __init__(
        self,
        link: LocalLink,
        stage: int,
        ranks: list[int],
        device: torch.device,
        timeout: float,
        backend: str,
    ) -> None:
        import datetime

        self.link = link
        self.stage = stage
        self.ranks = list(ranks)
        self.device = device
        self.timeout = float(timeout)
        self._td = datetime.timedelta(seconds=self.timeout)
        self.backend = self.name = backend
        self.meta: dict[tuple[str, str], Signature] = {}
        #: the up end: where an error it receives goes on (the stage's down side)
        self.onward: Any = None
        #: called as accept(old, new, mb) when an activation arrives with new shapes
        self.accept: Any = None
        self.shape_changes = 0
        self.flags = False
        self.arrived_flags: dict[int, Tensor] = {}
        self._shapes: Any = None  # the shapes of the last activation received (up end)

    @property
    def _is_down(self) -> bool:
        return self is self.link.down

    def who(self, stage: int) -> str:
        return f"stage {stage} (rank {self.ranks[stage]})"

    def unsupported(self, tree: Any) -> str:
        return ""  # nothing leaves the process: any tensor can be handed over

    # ------------------------------------------------------------------ handshake

    def send_meta(self, channel: str, tree: Any | None) -> None:
        self.link.signature = None if tree is None else Signature.of(tree)
        self.link.announced = True

    def recv_meta(self, channel: str) -> Signature | None:
        if not self.link.announced:
            raise PeerError(
                f"{self.who(self.stage)} receives the handshake from {self.who(self.stage - 1)} "
                "on its own rank before that stage announced its output (stages must be "
                "handshaken in increasing order)"
            )
        sig = self.link.signature
        if sig is not None:
            self._shapes = _shapes(sig)
        return sig

    # ------------------------------------------------------------------ data

    def send(self, channel: str, stage: int, mb: int, value: Any, flag: Tensor | None = None) -> None:
        self.link.box[(channel, mb)] = (value, flag)

    def recv(self, channel: str, stage: int, mb: int, certain: int | None = None) -> Any:
        link = self.link
        if channel == "act" and link.error is not None:
            message, link.error = link.error, None
            self.poison(message)
            raise PipelineInputError(message)
        try:
            value, flag = link.box.pop((channel, mb))
        except KeyError:
            raise PeerError(
                f"{self.who(self.stage)} receives the {channel} of micro-batch {mb} from a stage "
                "on its own rank before that stage sent it: the program's rank order runs a "
                "receive before its send (the validator refuses such programs)"
            ) from None
        if channel == "act" and self.accept is not None:
            self._check_shapes(value, mb)
        if channel == "grad" and self.flags:
            self.arrived_flags[mb] = (
                flag.reshape(1).float() if flag is not None
                else torch.zeros(1, dtype=torch.float32, device=self.device)
            )
        return value

    def _check_shapes(self, value: Any, mb: int) -> None:
        """A new set of activation shapes: the stage's dry run (as a P2P receive does), so a
        shape it cannot take is an error passed on down the pipeline, not a crash mid-step."""
        sig = Signature.of(value)
        shapes = _shapes(sig)
        if shapes == self._shapes:
            return
        old = self.link.signature if self.link.signature is not None else sig
        problem = self.accept(old, sig, mb)
        if problem:
            self.poison(problem)
            raise PipelineInputError(problem)
        self._shapes = shapes

    def poison(self, message: str) -> None:
        """Down end: leave ``message`` for the next stage in place of its next activation. Up
        end: pass it on through the stage's down side."""
        if self._is_down:
            self.link.error = message
        elif self.onward is not None:
            self.onward.poison(message)

    def release(self, channel: str, mbs: list[int]) -> None:
        """Nothing to release: no send is in flight."""

    def wait_sends(self) -> None:
        """Nothing to wait for: a hand-over completes at once."""

    def held(self) -> int:
        """Values this end handed over that the other end has not taken."""
        mine = "act" if self._is_down else "grad"
        return sum(1 for channel, _ in self.link.box if channel == mine)

    def close(self) -> None:
        self.link.box.clear()
        self.link.error = None
        self.arrived_flags.clear()


def _shapes(sig: Signature) -> tuple[tuple[int, ...], ...]:
    return tuple(m.shape for _, m in sig.metas(False))
