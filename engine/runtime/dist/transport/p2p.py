"""Point-to-point transport between processes: gloo (CPU tensors) and NCCL (GPU tensors).

One process holds one stage. The executor runs the stage's action stream from the schedule
IR; ``SF``/``SB`` become non-blocking sends and ``RF``/``RB`` blocking receives with a
timeout, so a dead or stuck peer surfaces as a :class:`PeerError` naming it instead of a
hang. Every collective the runtime issues (handshake, loss broadcast, gradient all-reduce)
goes through :meth:`P2PTransport.wait` with the same timeout.

Shapes and dtypes are agreed at the first step (:meth:`send_meta` / :meth:`recv_meta`,
driven by the pipeline's handshake), and every later send is checked against the agreement,
so a mismatch is a :class:`ShapeAgreementError` naming both ranks rather than a garbled
tensor. A stage may pass a tree of tensors (:mod:`engine.runtime.stage.trees`): the agreement is
its :class:`~engine.runtime.stage.trees.Signature` (structure, constants, and each tensor leaf's
path, shape, dtype and requires_grad), sent as a pickled skeleton. Per micro-batch an
activation is an 8-byte header and one message per tensor leaf, in leaf order (under gloo the
header rides inside the first leaf's message when that leaf is small: framing.py); a gradient
is one message per leaf that requires grad (none when no leaf does) and its trailers
(trailers.py: the non-finite flag, the loss scale); constants are never sent again.

Variable shapes: the structure, constants, dtypes and requires_grad are fixed at the
handshake, but tensor shapes may change from one micro-batch to the next (sequence length,
batch size). The header says 0 when the activation has the shapes of the sender's previous
one, and n > 0 when a new Signature follows as an n-byte metadata message (tag
:data:`META_TAG`). The receiving stage then checks once per new set of shapes that its
module accepts them (:attr:`accept`, a dry run); if not, it raises naming the stage, the leaf
paths and both shapes, and sends the error text downstream in place of the next header
(n < 0), so later stages raise it too instead of waiting. Gradients need no header: the
gradient of micro-batch i has the shapes of the activation of i, which both ends remember.
Under gloo the receiver posts micro-batch i+1's receives for the shapes of i before its
header arrives; a change completes them with the header and fills of at most one byte per
leaf, then the tensors of the new shapes follow. NCCL needs equal sizes at both ends and
posts nothing ahead, so it receives the header (always a message of its own) first.

gloo specifics (4 ranks sharing 2 cores, bench/README.md; one host's neighbours: shm.py):

* gloo's TCP transport is a rendezvous protocol: a send whose receive is not posted yet only
  announces itself, and the payload leaves later from the *sender's* gloo thread once the
  receiver's "receive ready" notice comes back. A receive posted before the send arrives lets
  the sender write the payload at once. So the executor tells :meth:`P2PTransport.recv` how
  many micro-batches of the channel this call will certainly receive, and the transport keeps
  up to :attr:`P2PTransport.prepost` receives posted ahead (gloo only: NCCL serialises a
  rank's P2P operations on its communication stream, where an early receive would hold up the
  sends queued behind it). Only receives the executor guarantees are posted ahead, so none is
  left dangling for a later pipeline on the same group to match by mistake.
* gloo's ``Work.is_completed()`` stays False until ``wait()`` is called, so completion cannot
  be polled. Sends are forgotten where their completion is implied instead, by waiting on
  them (which then returns at once):

  - the activation of micro-batch i has left once the gradient of i came back from that stage
    (which received the activation before computing it);
  - the gradient of micro-batch n has left once this stage received, from the previous stage,
    the activation of a micro-batch m whose send ``SF m`` comes after ``B n`` in that stage's
    own action stream: a stream runs in order and ``B n`` runs only after its receive
    ``RB n`` returned. The executor derives which gradients these are from the schedule IR
    (the previous stage's stream) and calls :meth:`P2PTransport.release`. Only a *completed*
    ``B`` counts: a receive the previous stage merely posted ahead proves nothing. Without
    this rule asynchronous schedules (which never flush between steps) held every sent
    gradient until the next flush;
  - everything else at :meth:`wait_sends` (the end of a synchronous step, a flush).

NCCL specifics (written for one GPU per rank; not run on CPU-only machines):

* sends and receives are issued with ``torch.distributed.batch_isend_irecv`` on a dedicated
  communication stream, so transfers overlap the compute stream;
* a send first makes the communication stream wait on an event recorded on the compute
  stream after the producing kernels (the data is complete before it leaves);
* a receive's ``work.wait()`` is called from the compute stream, which makes the compute
  stream (not the host) wait for the transfer before any kernel reads the buffer;
* ProcessGroupNCCL records the tensors on its internal stream, and the transport keeps every
  sent tensor referenced until :meth:`wait_sends`, so no buffer is reused while in flight.

NCCL waits are stream-side: timeouts there come from the process group's own ``timeout``
(its watchdog aborts the communicator), which :func:`engine.runtime.dist.distributed.init` sets to
the pipeline's ``timeout``.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engine.errors import PipelineInputError
from engine.runtime.dist.first_failure import first
from engine.runtime.dist.transport.abort import DROP_MARK, MARK, AbortFrames, Aborted, Dropped, frame_kind
from engine.runtime.dist.transport.base import PeerError, ShapeAgreementError, Transport
from engine.runtime.dist.transport.framing import Posted, fills, frame, framed_buffers, head_message, read_header
from engine.runtime.dist.transport.framing import inline as inline_header
from engine.runtime.dist.transport.groups import GroupCalls
from engine.runtime.dist.transport.handshake import Handshake
from engine.runtime.dist.transport.shm import SharedMemorySetup
from engine.runtime.dist.transport.trailers import take_trailers, trailer_buffers, with_trailers
from engine.runtime.stage.trees import Signature, flatten

__all__ = ["P2PTransport", "HEADER_TAG", "META_TAG"]

#: gloo tags of the per-activation header and of a new Signature (data: tag 0; loss: 7)
HEADER_TAG, META_TAG = 8, 9


class P2PTransport(AbortFrames, Handshake, SharedMemorySetup, Transport):
    """Blocking receives / asynchronous sends to the neighbouring stages' ranks.

    Args:
        backend: "gloo" or "nccl".
        stage: the stage this process runs.
        ranks: global rank of every stage of this process's pipeline (replica).
        group: the process group containing ``ranks`` (None: the default group).
        device: where received tensors are allocated.
        timeout: seconds any single wait may take before raising :class:`PeerError`.
    """

    blocking = True
    #: receives of a channel kept posted ahead of the one being waited for (gloo): the
    #: activation headers, and the gradients (whose shapes are known from the activation)
    prepost = 2

    def __init__(
        self, backend: str, stage: int, ranks: list[int], group: Any, device: torch.device,
        timeout: float,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}; use 'gloo' (CPU) or 'nccl' (GPU)")
        self.name = backend
        self.backend = backend
        self.stage = stage
        self.ranks = list(ranks)
        self.S = len(ranks)
        self.group = group
        self.device = device
        self.timeout = float(timeout)
        self._td = datetime.timedelta(seconds=self.timeout)
        # (channel, micro-batch) -> (works, tensors kept alive, what it was); one work per
        # tensor leaf; insertion-ordered
        self._sends: dict[tuple[str, int], tuple[list[Any], list[Tensor], str]] = {}
        # receives posted ahead (gloo): (channel, micro-batch) -> (works, buffers, the
        # Signature they were posted for)
        self._posted: dict[tuple[str, int], Posted] = {}
        # the agreed activation Signature per direction: ("act"|"grad", "send"|"recv"); the
        # grad channel carries the leaves of the same Signature that require grad
        self.meta: dict[tuple[str, str], Signature] = {}
        # the Signature each micro-batch's activation travelled with (sent / received), until
        # its gradient travelled back with the same shapes
        self._sent_sigs: dict[int, Signature] = {}
        self._recv_sigs: dict[int, Signature] = {}
        self._pending_shapes: dict[str, dict[int, list[list[int]]]] = {}
        # activation headers posted ahead (gloo): micro-batch -> (work, header)
        self._heads: dict[int, tuple[Any, Tensor]] = {}
        #: called as accept(old, new, mb) when an activation arrives with new shapes: why this
        #: stage cannot take them ("" when it can); set by the rank's runtime
        self.accept: Any = None
        #: how many metadata messages (new Signatures) this rank sent since the handshake
        self.shape_changes = 0
        self.comm_stream: Any = None
        self._gloo = GroupCalls(group)  # point-to-point calls on it (gloo)
        #: gradients carry trailers (trailers.py: skip_update's flag, float16's loss scale)
        self.flags = self.scales = False
        self.arrived_flags: dict[int, Tensor] = {}
        self.arrived_scales: dict[int, Tensor] = {}
        if backend == "nccl":
            if device.type != "cuda":
                raise ValueError(
                    "transport='nccl' moves CUDA tensors: give each rank its GPU "
                    "(torch.cuda.set_device(local_rank)) or use transport='gloo' on CPU"
                )
            self.comm_stream = torch.cuda.Stream(device=device)

    # ------------------------------------------------------------------ naming

    def peer_stage(self, channel: str, direction: str) -> int:
        """The stage at the other end of ``channel`` when this stage ``direction``s."""
        down = (channel == "act") == (direction == "send")
        return self.stage + 1 if down else self.stage - 1

    def who(self, stage: int) -> str:
        return f"stage {stage} (rank {self.ranks[stage]})"

    # ------------------------------------------------------------------ waiting

    def wait(self, work: Any, what: str, peer: int | None = None) -> None:
        """Wait for ``work`` at most ``timeout`` seconds; raise PeerError naming the peer."""
        try:
            if self.backend == "gloo" and self._td is not None:
                work.wait(self._td)
            else:
                work.wait()
        except Exception as exc:  # gloo raises RuntimeError on reset/timeout; name the peer
            raise self.peer_error(exc, what, peer) from exc

    def peer_error(self, exc: BaseException, what: str, peer: int | None) -> PeerError:
        """``exc`` from torch.distributed (posting or waiting) as a PeerError naming the peer
        stage and rank, and the first rank to fail in the job (first_failure.py). A broken
        connection blames the peer (``broken``, ``peer_rank``: the note report() writes)."""
        peer_txt = f" with {self.who(peer)}" if peer is not None else ""
        text = str(exc).strip()
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        why = f"no answer within timeout={self.timeout:g}s" if timed_out else "the connection broke"
        err = PeerError(
            f"{self.who(self.stage)}: {what}{peer_txt} failed: {why} "
            f"({type(exc).__name__}: {text[:300]}). The peer rank most likely died or is "
            "stuck: check its log for the first error. This rank stops instead of hanging "
            "(raise Pipeline(timeout=...) if a stage is legitimately slower)."
            + first(self.ranks[self.stage])
        )
        err.broken = not timed_out  # type: ignore[attr-defined]
        err.peer_rank = self.ranks[peer] if peer is not None else None  # type: ignore[attr-defined]
        return err

    # ------------------------------------------------------------------ data

    def _check(
        self, channel: str, mb: int, value: Any
    ) -> tuple[list[Tensor], Signature | None]:
        """The tensors to send for ``value`` on ``channel``, checked against the agreement,
        and the activation's new Signature when only its shapes changed (else None)."""
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

    def send(
        self, channel: str, stage: int, mb: int, value: Any, flag: Tensor | None = None,
        scale: Tensor | None = None,
    ) -> None:
        if not isinstance(value, (Tensor, tuple, list, dict)) and not (
            value is None and channel == "grad"
        ):
            raise PeerError(
                f"{self.who(self.stage)} has no tensor to send on the {channel} channel for "
                f"micro-batch {mb} (got {value!r}); distributed transports carry tensors only"
            )
        tensors, new = self._check(channel, mb, value)
        if channel == "grad":
            tensors = with_trailers(tensors, self, flag, scale)
        if not tensors and channel == "grad":
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
                ts, tags = [self._small(torch.tensor([0], dtype=torch.int64)), *ts], [HEADER_TAG, *tags]
            if announce:
                ts, tags = announce + ts, atags + tags
        works = self._isend(ts, tags, self.ranks[self.peer_stage(channel, "send")])
        earlier = self._sends.pop((channel, mb), None)
        if earlier is not None:  # a send of an earlier segment that nobody waited for
            self._wait_all(earlier[0], earlier[2])
        self._sends[(channel, mb)] = (works, ts, f"sending the {channel} of micro-batch {mb}")
        if self.backend == "nccl":
            self._reap()

    def _announce(self, old: Signature | None, n: int, body: bytes) -> tuple[list[Tensor], list[int]]:
        """Header ``n`` and its ``body`` (a Signature or an error) in place of an activation
        of ``old``'s shapes: under gloo the receives posted for ``old`` are completed by the
        header (inline) and by fills (framing.py)."""
        msg = self._small(torch.frombuffer(bytearray(body), dtype=torch.uint8))
        if inline_header(self.backend, old):
            rest = fills(old)[1:]  # type: ignore[arg-type]
            return [head_message(n), *rest, msg], [0] * (1 + len(rest)) + [META_TAG]
        ts = [self._small(torch.tensor([n], dtype=torch.int64)), msg]
        if self.backend == "gloo" and old is not None:
            ts += fills(old)
        return ts, [HEADER_TAG, META_TAG] + [0] * (len(ts) - 2)

    def _small(self, t: Tensor) -> Tensor:
        return t.to(self._meta_device())

    def _isend(self, ts: list[Tensor], tags: list[int], peer: int) -> list[Any]:
        try:  # posting fails at once when the peer's connection is already gone
            return self._isend_raw(ts, tags, peer)
        except PeerError:
            raise
        except RuntimeError as exc:
            raise self.peer_error(exc, "sending", self.ranks.index(peer)) from exc

    def _isend_raw(self, ts: list[Tensor], tags: list[int], peer: int) -> list[Any]:
        if self.backend == "gloo":
            return [self._gloo.send(t, peer, g) for t, g in zip(ts, tags, strict=True)]
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.comm_stream):
            self.comm_stream.wait_event(ready)
            return dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, t, peer, self.group, g) for t, g in zip(ts, tags, strict=True)]
            )

    def _irecv(self, buf: Tensor, src: int, tag: int) -> Any:
        if self.backend == "gloo":
            try:
                return self._gloo.recv(buf, self.ranks[src], tag)
            except RuntimeError as exc:
                raise self.peer_error(exc, "receiving", src) from exc
        with torch.cuda.stream(self.comm_stream):
            (work,) = dist.batch_isend_irecv(
                [dist.P2POp(dist.irecv, buf, self.ranks[src], self.group, tag)]
            )
        return work

    def _signature(self, mb: int, src: int, posted: Posted | None) -> Signature:
        """Receive micro-batch ``mb``'s activation header (and a new Signature if its shapes
        changed): the Signature its tensors arrive with. ``posted``: the receive already
        posted for its tensors (gloo), which a change or an error from upstream completes
        (header inline: its first work, which this waits for, holds the header)."""
        what = f"receiving the header of micro-batch {mb}'s activation"
        rest = [] if posted is None else posted.works
        if posted is not None and posted.head is not None:
            self.wait(posted.works[0], what, src)
            n, rest = read_header(posted.head), posted.works[1:]
            posted.works = rest
        else:
            work, head = self._heads.pop(mb, None) or self._post_head(src)
            self.wait(work, what, src)
            n = int(head.cpu()[0])
        current = self.meta[("act", "recv")]
        if n == 0:
            return current
        body = torch.empty(abs(n), dtype=torch.uint8, device=self._meta_device())
        self.wait(self._irecv(body, src, META_TAG), what, src)
        data = body.cpu().numpy().tobytes()
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
        head = torch.zeros(1, dtype=torch.int64, device=self._meta_device())
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

    def _wait_all(self, works: list[Any], what: str, peer: int | None = None) -> None:
        for work in works:
            self.wait(work, what, peer)

    def recv(self, channel: str, stage: int, mb: int, certain: int | None = None) -> Any:
        """The tensor (or tree; or the list of gradients of a tree's leaves that require grad)
        of micro-batch ``mb`` on ``channel`` (blocking, at most ``timeout``).

        ``certain``: the executor guarantees that this call receives every micro-batch below
        it on this channel; under gloo up to :attr:`prepost` of them beyond ``mb`` are posted
        now, in order, so their senders find the receive waiting (see the module docstring).
        """
        agreed = self.meta.get((channel, "recv"))
        src = self.peer_stage(channel, "recv")
        if agreed is None:
            raise ShapeAgreementError(
                f"{self.who(self.stage)} receives on the {channel} channel from {self.who(src)} "
                "before the shapes were agreed; the pipeline's first step performs the handshake"
            )
        if channel == "grad":
            agreed = self._sent_sigs.pop(mb, agreed)  # the shapes mb's activation left with
        if channel == "grad" and not agreed.grad_at and not self.flags and not self.scales:
            # no leaf carries a gradient, so no message proves that the activation arrived:
            # wait for its send instead (the peer receives it before it would send a gradient)
            sent = self._sends.pop(("act", mb), None)
            if sent is not None:
                self._wait_all(sent[0], sent[2], self.peer_stage("act", "send"))
            return None if agreed.single else []
        posted = self._posted.pop((channel, mb), None)
        if channel == "act":
            if posted is None and self.backend == "gloo":  # for the previous shapes
                posted = self._post(channel, mb, agreed, src)
            agreed = self._signature(mb, src, posted)
            self._recv_sigs[mb] = agreed
            if posted is not None and posted.sig is not agreed:
                posted = None  # the shapes changed: that receive took the sender's fill
        check_head = posted is None
        if posted is None:
            posted = self._post(channel, mb, agreed, src)
        if certain is not None and self.backend == "gloo" and mb + 1 < certain:
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
        if channel == "grad" and self.backend == "gloo":
            # the next stage received this micro-batch's activation before computing its
            # gradient: that send has completed, so waiting on it returns at once
            sent = self._sends.pop(("act", mb), None)
            if sent is not None:
                self._wait_all(sent[0], sent[2], self.peer_stage("act", "send"))
        kind = frame_kind(bufs[0]) if channel == "grad" and bufs and self.backend == "gloo" else ""
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
        consumed by the peer (gloo: waiting on them returns at once; see the module docstring).
        Micro-batches without a held send are ignored. NCCL forgets sends by polling instead."""
        if self.backend != "gloo":
            return
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
        if self.backend == "gloo":
            try:
                works = [self._gloo.recv(b, self.ranks[src], 0) for b in msgs]
            except RuntimeError as exc:
                raise self.peer_error(exc, f"receiving the {channel} of micro-batch {mb}", src) from exc
            return Posted(works, bufs, agreed, head)
        with torch.cuda.stream(self.comm_stream):
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.irecv, b, self.ranks[src], self.group) for b in msgs]
            )
        # waited on from the compute stream: it waits (on the device) for the transfer
        return Posted(works, bufs, agreed)

    def _reap(self) -> None:
        """NCCL: forget sends that completed. Until then the transport holds each sent
        tensor, so the caching allocator cannot hand its memory to a new tensor while NCCL (on
        its own stream) still reads it. (gloo cannot be polled: see the module docstring.)"""
        self._sends = {
            k: s for k, s in self._sends.items() if not all(w.is_completed() for w in s[0])
        }

    def wait_sends(self) -> None:
        """gloo: block until every send has left. NCCL: order the current stream after every
        send (device-side); tensors stay referenced until their work reports completion."""
        for works, _t, what in self._sends.values():
            self._wait_all(works, what)
        if self.backend == "gloo":
            self._sends.clear()  # every one was waited for
        else:
            self._reap()

    def held(self) -> int:
        """Works and bookkeeping this transport still holds (0 after a synchronous step)."""
        return (len(self._sends) + len(self._posted) + len(self._heads) + len(self._sent_sigs)
                + len(self._recv_sigs))

    def settle_for_exit(self) -> None:
        """At interpreter exit (transport/teardown.py): sends waited for briefly, then the
        transport forgets everything (receives posted ahead end with the group)."""
        from engine.runtime.dist.transport.teardown import settle

        for works, _t, _what in self._sends.values():
            settle(works)
        self.close()

    def close(self) -> None:
        self._gloo.forget()  # (release_groups: the transport must not keep the group alive)
        self._sends.clear()
        self._posted.clear()
        self._heads.clear()
        self._sent_sigs.clear()
        self._recv_sigs.clear()
        self._pending_shapes.clear()
        self.arrived_flags.clear()
        self.arrived_scales.clear()
