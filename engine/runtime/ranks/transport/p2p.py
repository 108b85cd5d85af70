"""What the two multi-process transports share: naming, waiting, the agreement check.

One process holds one stage (or, with virtual stages, one side of a boundary). The executor
runs the stage's action stream from the schedule IR; ``SF``/``SB`` become asynchronous sends,
``RF``/``RB`` receives. Two transports implement that over torch.distributed:

* :class:`~engine.runtime.ranks.transport.gloo.GlooTransport` (CPU tensors): gloo's tagged,
  eagerly progressing point-to-point messages, receives posted ahead, an 8-byte header per
  activation (so shapes may change at any micro-batch), abort frames in band, and
  shared-memory rings between neighbours on one host;
* :class:`~engine.runtime.ranks.transport.nccl.NCCLTransport` (GPU tensors): NCCL's untagged,
  in-order communicators, one per channel direction, batched posts, no header and no host
  read while shapes stay the same, and every host message on the control plane
  (:mod:`~engine.runtime.ranks.transport.control`).

Both agree shapes and dtypes at the first step (the handshake,
:mod:`~engine.runtime.ranks.transport.handshake`) and check every later message against the
agreement here (:meth:`P2PTransport._check`), so a mismatch is a
:class:`~engine.errors.ShapeAgreementError` naming both ranks rather than a garbled tensor. A
stage may pass a tree of tensors (:mod:`engine.runtime.stage.trees`): the agreement is its
:class:`~engine.runtime.stage.trees.Signature`. A gradient is one message per leaf that
requires grad (none when no leaf does) and its trailers
(:mod:`~engine.runtime.ranks.transport.trailers`); the gradient of micro-batch i has the
shapes of the activation of i, which both ends remember.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
from torch import Tensor

from engine.runtime.ranks.first_failure import first
from engine.runtime.ranks.transport.base import PeerError, ShapeAgreementError, Transport
from engine.runtime.ranks.transport.handshake import Handshake
from engine.runtime.ranks.transport.trailers import with_trailers
from engine.runtime.stage.trees import Signature, flatten

__all__ = ["P2PTransport"]


class P2PTransport(Handshake, Transport):
    """The state and checks of one stage's point-to-point transport (module docstring).

    Args:
        stage: the stage this process runs.
        ranks: global rank of every stage of this process's pipeline (replica).
        device: where received tensors are allocated.
        timeout: seconds any single wait may take before raising :class:`PeerError`.
    """

    blocking = True
    backend = "?"

    def __init__(self, stage: int, ranks: list[int], device: torch.device, timeout: float) -> None:
        self.name = self.backend
        self.stage = stage
        self.ranks = list(ranks)
        self.S = len(ranks)
        self.device = device
        self.timeout = float(timeout)
        self._td = datetime.timedelta(seconds=self.timeout)
        # (channel, micro-batch) -> (works, tensors kept alive, what it was); one work per
        # message; insertion-ordered
        self._sends: dict[tuple[str, int], tuple[list[Any], list[Tensor], str]] = {}
        # the agreed activation Signature per direction: ("act"|"grad", "send"|"recv"); the
        # grad channel carries the leaves of the same Signature that require grad
        self.meta: dict[tuple[str, str], Signature] = {}
        # the Signature each micro-batch's activation travelled with (sent / received), until
        # its gradient travelled back with the same shapes
        self._sent_sigs: dict[int, Signature] = {}
        self._recv_sigs: dict[int, Signature] = {}
        self._pending_shapes: dict[str, dict[int, list[list[int]]]] = {}
        #: called as accept(old, new, mb) when an activation arrives with new shapes: why this
        #: stage cannot take them ("" when it can); set by the rank's runtime
        self.accept: Any = None
        #: how many metadata messages (new Signatures) this rank sent since the handshake
        self.shape_changes = 0
        #: gradients carry trailers (trailers.py: skip_update's flag, float16's loss scale)
        self.flags = self.scales = False
        self.arrived_flags: dict[int, Tensor] = {}
        self.arrived_scales: dict[int, Tensor] = {}

    # ------------------------------------------------------------------ naming

    def peer_stage(self, channel: str, direction: str) -> int:
        """The stage at the other end of ``channel`` when this stage ``direction``s."""
        down = (channel == "act") == (direction == "send")
        return self.stage + 1 if down else self.stage - 1

    def who(self, stage: int) -> str:
        return f"stage {stage} (rank {self.ranks[stage]})"

    # ------------------------------------------------------------------ waiting

    def wait(self, work: Any, what: str, peer: int | None = None) -> None:
        """Wait for ``work`` (at most ``timeout`` where the backend's wait takes one); raise
        PeerError naming the peer."""
        try:
            work.wait(self._td)
        except Exception as exc:  # the backend raises RuntimeError on reset/timeout: name the peer
            raise self.peer_error(exc, what, peer) from exc

    def wait_host(self, work: Any, what: str, peer: int | None = None) -> None:
        """A work waited for on the host, at most ``timeout`` (control-plane messages)."""
        P2PTransport.wait(self, work, what, peer)

    def _wait_all(self, works: list[Any], what: str, peer: int | None = None) -> None:
        for work in works:
            self.wait(work, what, peer)

    def peer_error(self, exc: BaseException, what: str, peer: int | None) -> PeerError:
        """``exc`` from torch.distributed (posting or waiting) as a PeerError naming the peer
        stage and rank, and the first rank to fail in the job (first_failure.py). A broken
        connection blames the peer (``broken``, ``peer_rank``: the note report() writes)."""
        peer_txt = f" with {self.who(peer)}" if peer is not None else ""
        text = str(exc).strip()
        deadlock = "deadlock" in text.lower()  # (the NCCL twin's report: kept whole)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        why = f"no answer within timeout={self.timeout:g}s" if timed_out else "the connection broke"
        hint = (
            "The peer rank most likely died or is stuck: check its log for the first error. "
            "This rank stops instead of hanging (raise Pipeline(timeout=...) if a stage is "
            "legitimately slower)."
        )
        if deadlock:
            why = "a deadlock (every rank waiting, nothing progressing)"
            hint = ("The ranks' communication orders cannot all complete: the report above names "
                    "each rank's queue head.")
        err = PeerError(
            f"{self.who(self.stage)}: {what}{peer_txt} failed: {why} "
            f"({type(exc).__name__}: {text if deadlock else text[:600]}). {hint}"
            + first(self.ranks[self.stage])
        )
        err.broken = not timed_out  # type: ignore[attr-defined]
        err.peer_rank = self.ranks[peer] if peer is not None else None  # type: ignore[attr-defined]
        return err

    # ------------------------------------------------------------------ the agreement

    def _check(
        self, channel: str, mb: int, value: Any
    ) -> tuple[list[Tensor], Signature | None]:
        """The tensors to send for ``value`` on ``channel``, checked against the agreement,
        and the activation's new Signature when only its shapes changed (else None)."""
        if not isinstance(value, (Tensor, tuple, list, dict)) and not (
            value is None and channel == "grad"
        ):
            raise PeerError(
                f"{self.who(self.stage)} has no tensor to send on the {channel} channel for "
                f"micro-batch {mb} (got {value!r}); distributed transports carry tensors only"
            )
        agreed = self.meta.get((channel, "send"))
        peer = self.peer_stage(channel, "send")
        if agreed is None:
            raise ShapeAgreementError(
                f"{self.who(self.stage)} sends on the {channel} channel to {self.who(peer)} before "
                "the shapes were agreed; the pipeline's first step performs the handshake"
            )
        what = "activation" if channel == "act" else "input gradient"
        if channel == "act":
            why = agreed.mismatch(value)
            new = agreed.reshaped(value) if why else None
            if not why or new is not None:
                if agreed.single:
                    return [value], new
                return [t for t in flatten(value)[0] if isinstance(t, Tensor)], new
        else:
            agreed = self._recv_sigs.pop(mb, agreed)  # the shapes of micro-batch mb
            grads = [] if value is None else [value] if isinstance(value, Tensor) else list(value)
            why = agreed.grad_mismatch(grads)
            if not why:
                return grads, None
        raise ShapeAgreementError(
            f"{self.who(self.stage)} produced an {what} for micro-batch {mb} that does not fit "
            f"what {self.who(peer)} agreed to receive at the first step's handshake: {why}. Under "
            "transport='gloo'/'nccl' every micro-batch must have the structure, constants, dtypes "
            "and requires_grad of the first one (only tensor shapes may change)."
        )

    def _outgoing(
        self, channel: str, mb: int, value: Any, flag: Tensor | None, scale: Tensor | None
    ) -> tuple[list[Tensor] | None, Signature | None]:
        """What :meth:`send` puts on the wire for ``value``: its tensors (a gradient's with
        its trailers; None when nothing travels: no leaf carries a gradient) and the
        activation's new Signature when only its shapes changed."""
        tensors, new = self._check(channel, mb, value)
        if channel == "grad":
            tensors = with_trailers(tensors, self, flag, scale)
            if not tensors:
                return None, None
        return tensors, new

    def _agreed_recv(self, channel: str, mb: int) -> Signature:
        """The Signature ``mb`` arrives with on ``channel`` (gradients: the shapes its
        activation left with), or ShapeAgreementError before the handshake."""
        agreed = self.meta.get((channel, "recv"))
        if agreed is None:
            src = self.peer_stage(channel, "recv")
            raise ShapeAgreementError(
                f"{self.who(self.stage)} receives on the {channel} channel from {self.who(src)} "
                "before the shapes were agreed; the pipeline's first step performs the handshake"
            )
        if channel == "grad":
            agreed = self._sent_sigs.pop(mb, agreed)
        return agreed

    def _no_gradient(self, agreed: Signature) -> bool:
        """Whether a gradient of ``agreed``'s activation is no message at all (no leaf
        requires grad and no trailer rides behind it)."""
        return not agreed.grad_at and not self.flags and not self.scales

    # ------------------------------------------------------------------ bookkeeping

    def held(self) -> int:
        """Works and bookkeeping this transport still holds (0 after a synchronous step)."""
        return len(self._sends) + len(self._sent_sigs) + len(self._recv_sigs)

    def settle_for_exit(self) -> None:
        """At interpreter exit (transport/teardown.py): sends waited for briefly, then the
        transport forgets everything (receives posted ahead end with the group)."""
        from engine.runtime.ranks.transport.teardown import settle

        for works, _t, _what in self._sends.values():
            settle(works)
        self.close()

    def close(self) -> None:
        self._sends.clear()
        self._sent_sigs.clear()
        self._recv_sigs.clear()
        self._pending_shapes.clear()
        self.arrived_flags.clear()
        self.arrived_scales.clear()

