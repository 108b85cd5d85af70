"""The gloo transport: CPU tensors between processes, one stage per process.

``SF``/``SB`` become non-blocking sends and ``RF``/``RB`` blocking receives with a timeout, so
a dead or stuck peer surfaces as a :class:`~engine.errors.PeerError` naming it instead of a
hang. Every collective the rank's runtime issues goes through :meth:`P2PTransport.wait` with
the same timeout.

Per micro-batch an activation is an 8-byte header and one message per tensor leaf, in leaf
order (the header rides inside the first leaf's message when that leaf is small: framing.py);
constants are never sent again.

Variable shapes: the structure, constants, dtypes and requires_grad are fixed at the
handshake, but tensor shapes may change from one micro-batch to the next (sequence length,
batch size). The header says 0 when the activation has the shapes of the sender's previous
one, and n > 0 when a new Signature follows as an n-byte metadata message (tag
:data:`META_TAG`). The receiving stage then checks once per new set of shapes that its
module accepts them (:attr:`accept`, a dry run); if not, it raises naming the stage, the leaf
paths and both shapes, and sends the error text downstream in place of the next header
(n < 0), so later stages raise it too instead of waiting. The receiver posts micro-batch
i+1's receives for the shapes of i before its header arrives; a change completes them with
the header and fills of at most one byte per leaf, then the tensors of the new shapes follow.

gloo specifics (4 ranks sharing 2 cores, bench/README.md; one host's neighbours: shm.py):

* gloo's TCP transport is a rendezvous protocol: a send whose receive is not posted yet only
  announces itself, and the payload leaves later from the *sender's* gloo thread once the
  receiver's "receive ready" notice comes back. A receive posted before the send arrives lets
  the sender write the payload at once. So the executor tells :meth:`GlooTransport.recv` how
  many micro-batches of the channel this call will certainly receive, and the transport keeps
  up to :attr:`GlooTransport.prepost` receives posted ahead. Only receives the executor
  guarantees are posted ahead, so none is left dangling for a later pipeline on the same
  group to match by mistake.
* gloo's ``Work.is_completed()`` stays False until ``wait()`` is called, so completion cannot
  be polled. Sends are forgotten where their completion is implied instead, by waiting on
  them (which then returns at once):

  - the activation of micro-batch i has left once the gradient of i came back from that stage
    (which received the activation before computing it);
  - the gradient of micro-batch n has left once this stage received, from the previous stage,
    the activation of a micro-batch m whose send ``SF m`` comes after ``B n`` in that stage's
    own action stream: a stream runs in order and ``B n`` runs only after its receive
    ``RB n`` returned. The executor derives which gradients these are from the schedule IR
    (the previous stage's stream) and calls :meth:`GlooTransport.release`. Only a *completed*
    ``B`` counts: a receive the previous stage merely posted ahead proves nothing. Without
    this rule asynchronous schedules (which never flush between steps) held every sent
    gradient until the next flush;
  - everything else at :meth:`wait_sends` (the end of a synchronous step, a flush).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch import Tensor

from engine.errors import PipelineInputError
from engine.runtime.ranks.transport.abort import DROP_MARK, MARK, AbortFrames, Aborted, Dropped, frame_kind
from engine.runtime.ranks.transport.base import PeerError
from engine.runtime.ranks.transport.framing import Posted, fills, frame, framed_buffers, head_message, read_header
from engine.runtime.ranks.transport.framing import inline as inline_header
from engine.runtime.ranks.transport.groups import GroupCalls
from engine.runtime.ranks.transport.p2p import P2PTransport
from engine.runtime.ranks.transport.shm import SharedMemorySetup
from engine.runtime.ranks.transport.trailers import take_trailers, trailer_buffers
from engine.runtime.stage.trees import Signature

__all__ = ["GlooTransport", "HEADER_TAG", "META_TAG"]

#: gloo tags of the per-activation header and of a new Signature (data: tag 0; loss: 7)
HEADER_TAG, META_TAG = 8, 9


class GlooTransport(AbortFrames, SharedMemorySetup, P2PTransport):
    """Blocking receives / asynchronous sends to the neighbouring stages' ranks (gloo).

    Args:
        stage: the stage this process runs.
        ranks: global rank of every stage of this process's pipeline (replica).
        group: the gloo process group containing ``ranks`` (None: the default group).
        device: where received tensors are allocated (the CPU).
        timeout: seconds any single wait may take before raising :class:`PeerError`.
    """

    backend = "gloo"
    #: receives of a channel kept posted ahead of the one being waited for: the activation
    #: headers, and the gradients (whose shapes are known from the activation)
    prepost = 2

    def __init__(
        self, stage: int, ranks: list[int], group: Any, device: torch.device, timeout: float
    ) -> None:
        super().__init__(stage, ranks, device, timeout)
        self.group = group
        # receives posted ahead: (channel, micro-batch) -> (works, buffers, the Signature
        # they were posted for)
        self._posted: dict[tuple[str, int], Posted] = {}
        # activation headers posted ahead: micro-batch -> (work, header)
        self._heads: dict[int, tuple[Any, Tensor]] = {}
        self._gloo = GroupCalls(group)  # point-to-point calls on it

    # ------------------------------------------------------------------ the handshake's messages

    def meta_send(self, t: Tensor, peer: int) -> Any:
        return self._gloo.send(t, self.ranks[peer], 0)

    def meta_recv(self, buf: Tensor, peer: int) -> Any:
        return self._gloo.recv(buf, self.ranks[peer], 0)

    # ------------------------------------------------------------------ data

    def send(
        self, channel: str, stage: int, mb: int, value: Any, flag: Tensor | None = None,
        scale: Tensor | None = None,
    ) -> None:
        tensors, new = self._outgoing(channel, mb, value, flag, scale)
        if tensors is None:
            return  # no leaf carries a gradient: nothing travels
        ts = [t.detach().contiguous() for t in tensors]
        tags = [0] * len(ts)
        if channel == "act":
            old = self.meta[("act", "send")]
            announce: list[Tensor] = []
            if new is not None:
                body = pickle.dumps(new.skeleton)
                announce, atags = self._announce(old, len(body), body)
                self._agree("act", "send", new)
                self.shape_changes += 1
            sig = self.meta[("act", "send")]
            self._sent_sigs[mb] = sig
            if inline_header(self.backend, sig):
                ts[0] = frame(ts[0], 0)
            elif new is None:  # the header alone (after an announcement none follows)
                ts, tags = [torch.tensor([0], dtype=torch.int64), *ts], [HEADER_TAG, *tags]
            if announce:
                ts, tags = announce + ts, atags + tags
        works = self._isend(ts, tags, self.ranks[self.peer_stage(channel, "send")])
        earlier = self._sends.pop((channel, mb), None)
        if earlier is not None:  # a send of an earlier segment that nobody waited for
            self._wait_all(earlier[0], earlier[2])
        self._sends[(channel, mb)] = (works, ts, f"sending the {channel} of micro-batch {mb}")

    def _announce(self, old: Signature | None, n: int, body: bytes) -> tuple[list[Tensor], list[int]]:
        """Header ``n`` and its ``body`` (a Signature or an error) in place of an activation
        of ``old``'s shapes: the receives posted for ``old`` are completed by the header
        (inline) and by fills (framing.py)."""
        msg = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        if inline_header(self.backend, old):
            rest = fills(old)[1:]  # type: ignore[arg-type]
            return [head_message(n), *rest, msg], [0] * (1 + len(rest)) + [META_TAG]
        ts = [torch.tensor([n], dtype=torch.int64), msg]
        if old is not None:
            ts += fills(old)
        return ts, [HEADER_TAG, META_TAG] + [0] * (len(ts) - 2)

    def _isend(self, ts: list[Tensor], tags: list[int], peer: int) -> list[Any]:
        try:  # posting fails at once when the peer's connection is already gone
            return [self._gloo.send(t, peer, g) for t, g in zip(ts, tags, strict=True)]
        except RuntimeError as exc:
            raise self.peer_error(exc, "sending", self.ranks.index(peer)) from exc

    def _irecv(self, buf: Tensor, src: int, tag: int) -> Any:
        try:
            return self._gloo.recv(buf, self.ranks[src], tag)
        except RuntimeError as exc:
            raise self.peer_error(exc, "receiving", src) from exc

    def _signature(self, mb: int, src: int, posted: Posted | None) -> Signature:
        """Receive micro-batch ``mb``'s activation header (and a new Signature if its shapes
        changed): the Signature its tensors arrive with. ``posted``: the receive already
        posted for its tensors, which a change or an error from upstream completes (header
        inline: its first work, which this waits for, holds the header)."""
        what = f"receiving the header of micro-batch {mb}'s activation"
        rest = [] if posted is None else posted.works
        if posted is not None and posted.head is not None:
            self.wait(posted.works[0], what, src)
            n, rest = read_header(posted.head), posted.works[1:]
            posted.works = rest
        else:
            work, head = self._heads.pop(mb, None) or self._post_head(src)
            self.wait(work, what, src)
            n = read_header(head.view(torch.uint8))
        current = self.meta[("act", "recv")]
        if n == 0:
            return current
        body = torch.empty(abs(n), dtype=torch.uint8)
        self.wait(self._irecv(body, src, META_TAG), what, src)
        data = body.numpy().tobytes()
        self._wait_all(rest, f"receiving micro-batch {mb}'s fill", src)
        if n < 0 and data.startswith(MARK):  # a peer aborted the step (abort.py)
            raise Aborted(data[len(MARK):].decode(errors="replace"))
        if n < 0 and data.startswith(DROP_MARK):
            raise Dropped()
        if n < 0:  # an earlier stage stopped the step: pass its error on, then raise it
            self.poison(data.decode())
            raise PipelineInputError(data.decode())
        sig = Signature(pickle.loads(data))
        problem = self.accept(current, sig, mb) if self.accept is not None else ""
        if problem:
            self.poison(problem)
            raise PipelineInputError(problem)
        self._agree("act", "recv", sig)
        return sig

    def _post_head(self, src: int) -> tuple[Any, Tensor]:
        head = torch.zeros(1, dtype=torch.int64)
        return self._irecv(head, src, HEADER_TAG), head

    def poison(self, message: str) -> None:
        """Send ``message`` to the next stage in place of the next activation header, so that
        it (and every later stage, which it tells in turn) raises it instead of waiting. Waits
        at most ``timeout`` for the next stage to take it; a dead one is not an error here."""
        if self.stage == self.S - 1:
            return
        body = message.encode()
        ts, tags = self._announce(self.meta.get(("act", "send")), -len(body), body)
        works = self._isend(ts, tags, self.ranks[self.stage + 1])
        try:
            self._wait_all(works, "sending a step's error downstream")
        except PeerError:
            pass

    def recv(self, channel: str, stage: int, mb: int, certain: int | None = None) -> Any:
        """The tensor (or tree; or the list of gradients of a tree's leaves that require grad)
        of micro-batch ``mb`` on ``channel`` (blocking, at most ``timeout``).

        ``certain``: the executor guarantees that this call receives every micro-batch below
        it on this channel; up to :attr:`prepost` of them beyond ``mb`` are posted now, in
        order, so their senders find the receive waiting (see the module docstring).
        """
        src = self.peer_stage(channel, "recv")
        agreed = self._agreed_recv(channel, mb)
        if channel == "grad" and self._no_gradient(agreed):
            # no leaf carries a gradient, so no message proves that the activation arrived:
            # wait for its send instead (the peer receives it before it would send a gradient)
            sent = self._sends.pop(("act", mb), None)
            if sent is not None:
                self._wait_all(sent[0], sent[2], self.peer_stage("act", "send"))
            return None if agreed.single else []
        posted = self._posted.pop((channel, mb), None)
        if channel == "act":
            if posted is None:  # for the previous shapes
                posted = self._post(channel, mb, agreed, src)
            agreed = self._signature(mb, src, posted)
            self._recv_sigs[mb] = agreed
            if posted is not None and posted.sig is not agreed:
                posted = None  # the shapes changed: that receive took the sender's fill
        check_head = posted is None
        if posted is None:
            posted = self._post(channel, mb, agreed, src)
        if certain is not None and mb + 1 < certain:
            # messages of one (peer, tag) match receives in posting order. Activations: mb+1
            # only, for the shapes of mb (they may change at mb+1); gradients: up to prepost
            # ahead, once their activation left
            if channel == "act" and (channel, mb + 1) not in self._posted:
                self._posted[(channel, mb + 1)] = ahead = self._post(channel, mb + 1, agreed, src)
                if ahead.head is None and mb + 1 not in self._heads:
                    self._heads[mb + 1] = self._post_head(src)
            for later in range(mb + 1, min(certain, mb + 1 + self.prepost)) if channel == "grad" else ():
                if later not in self._sent_sigs:  # posting order is matching order: no gaps
                    break
                if (channel, later) not in self._posted:
                    self._posted[(channel, later)] = self._post(channel, later, self._sent_sigs[later], src)
        what = (
            f"receiving the {'activation' if channel == 'act' else 'gradient'} of micro-batch {mb}"
        )
        self._wait_all(posted.works, what, src)
        bufs = posted.bufs
        if check_head and posted.head is not None and read_header(posted.head) != 0:
            raise PeerError(
                f"{self.who(self.stage)}: micro-batch {mb}'s activation from {self.who(src)} "
                f"arrived with header {read_header(posted.head)} after its new shapes (expected 0): "
                "the two ranks disagree on the transport protocol (same engine version?)"
            )
        if channel == "grad":
            # the next stage received this micro-batch's activation before computing its
            # gradient: that send has completed, so waiting on it returns at once
            sent = self._sends.pop(("act", mb), None)
            if sent is not None:
                self._wait_all(sent[0], sent[2], self.peer_stage("act", "send"))
        kind = frame_kind(bufs[0]) if channel == "grad" and bufs else ""
        if kind:  # a gradient's abort or dropped frame (abort.py)
            raise Aborted() if kind == "abort" else Dropped()
        if channel == "grad":
            bufs = take_trailers(bufs, mb, self)
            if not bufs:  # no leaf carries a gradient (the flag came alone)
                return None if agreed.single else []
            return bufs[0] if agreed.single else bufs
        return agreed.build(bufs)

    def release(self, channel: str, mbs: list[int]) -> None:
        """Forget the sends of ``mbs`` on ``channel`` that the caller knows were received and
        consumed by the peer (waiting on them returns at once; see the module docstring).
        Micro-batches without a held send are ignored."""
        peer = self.peer_stage(channel, "send")
        for mb in mbs:
            sent = self._sends.pop((channel, mb), None)
            if sent is not None:
                self._wait_all(sent[0], sent[2], peer)

    def _post(self, channel: str, mb: int, agreed: Signature, src: int) -> Posted:
        if channel == "act" and inline_header(self.backend, agreed):
            bufs, msgs, head = framed_buffers(agreed.metas(grad=False), self.device)
        else:
            metas = agreed.metas(grad=channel == "grad")
            bufs = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for _, m in metas]
            if channel == "grad":
                bufs += trailer_buffers(self)
            msgs, head = list(bufs), None
        try:
            works = [self._gloo.recv(b, self.ranks[src], 0) for b in msgs]
        except RuntimeError as exc:
            raise self.peer_error(exc, f"receiving the {channel} of micro-batch {mb}", src) from exc
        return Posted(works, bufs, agreed, head)

    def wait_sends(self) -> None:
        """Block until every send has left."""
        for works, _t, what in self._sends.values():
            self._wait_all(works, what)
        self._sends.clear()  # every one was waited for

    def held(self) -> int:
        return super().held() + len(self._posted) + len(self._heads)

    def close(self) -> None:
        self._gloo.forget()  # (release_groups: the transport must not keep the group alive)
        self._posted.clear()
        self._heads.clear()
        super().close()
