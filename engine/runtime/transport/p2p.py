"""Point-to-point transport between processes: gloo (CPU tensors) and NCCL (GPU tensors).

One process holds one stage. The executor runs the stage's action stream from the schedule
IR; ``SF``/``SB`` become non-blocking sends and ``RF``/``RB`` blocking receives with a
timeout, so a dead or stuck peer surfaces as a :class:`PeerError` naming it instead of a
hang. Every collective the runtime issues (handshake, loss broadcast, gradient all-reduce)
goes through :meth:`P2PTransport.wait` with the same timeout.

Shapes and dtypes are agreed once, at the first step (:meth:`send_meta` / :meth:`recv_meta`,
driven by the pipeline's handshake): a receiver then allocates its buffers without any
per-message header, and every later send is checked against the agreement, so a mismatch is
a :class:`ShapeAgreementError` naming both ranks rather than a garbled tensor.

gloo specifics (measured on 4 ranks time-sharing 2 CPU cores, see bench/README.md):

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
(its watchdog aborts the communicator), which :func:`engine.runtime.distributed.init` sets to
the pipeline's ``timeout``.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engine.runtime.transport.base import PeerError, ShapeAgreementError, Transport

__all__ = ["P2PTransport", "DTYPES", "MAX_DIMS"]

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
MAX_DIMS = 8
_ERROR = -1  # ndim value of a meta message that says "the sender failed its dry run"


class P2PTransport(Transport):
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
    #: receives of a channel kept posted ahead of the one being waited for (gloo); each holds
    #: one buffer of the agreed shape
    prepost = 2

    def __init__(
        self,
        backend: str,
        stage: int,
        ranks: list[int],
        group: Any,
        device: torch.device,
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
        # (channel, micro-batch) -> (work, tensor kept alive, what it was); insertion-ordered
        self._sends: dict[tuple[str, int], tuple[Any, Tensor, str]] = {}
        # receives posted ahead (gloo): (channel, micro-batch) -> (work, buffer)
        self._posted: dict[tuple[str, int], tuple[Any, Tensor]] = {}
        # agreed (shape, dtype) per direction: ("act"|"grad", "send"|"recv")
        self.meta: dict[tuple[str, str], tuple[tuple[int, ...], torch.dtype]] = {}
        self.comm_stream: Any = None
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
            peer_txt = f" with {self.who(peer)}" if peer is not None else ""
            text = str(exc).strip()
            why = (
                f"no answer within timeout={self.timeout:g}s"
                if "timed out" in text.lower() or "timeout" in text.lower()
                else "the connection broke"
            )
            raise PeerError(
                f"{self.who(self.stage)}: {what}{peer_txt} failed: {why} "
                f"({type(exc).__name__}: {text[:300]}). The peer rank most likely died or is "
                "stuck: check its log for the first error. This rank stops instead of hanging "
                "(raise Pipeline(timeout=...) if a stage is legitimately slower)."
            ) from exc

    # ------------------------------------------------------------------ handshake

    def send_meta(self, channel: str, tensor: Tensor | None) -> None:
        """Announce the shape/dtype this stage will send on ``channel`` (None: my dry run
        failed; the receiver must not wait for data)."""
        peer = self.peer_stage(channel, "send")
        msg = torch.zeros(2 + MAX_DIMS, dtype=torch.int64)
        if tensor is None:
            msg[0] = _ERROR
        else:
            if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
                raise ShapeAgreementError(
                    f"{self.who(self.stage)} would send a tensor of {self.describe(tensor)} to "
                    f"{self.who(peer)}: supported are at most {MAX_DIMS} dims and dtypes "
                    f"{[str(d) for d in DTYPES]}"
                )
            msg[0] = tensor.dim()
            msg[1] = DTYPES.index(tensor.dtype)
            msg[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            self._agree(channel, "send", tuple(tensor.shape), tensor.dtype)
        self.wait(
            dist.isend(msg.to(self._meta_device()), self.ranks[peer], group=self.group),
            f"sending the {channel} handshake",
            peer,
        )

    def recv_meta(self, channel: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        """Receive the peer's announcement on ``channel``; None if the peer failed."""
        peer = self.peer_stage(channel, "recv")
        msg = torch.zeros(2 + MAX_DIMS, dtype=torch.int64, device=self._meta_device())
        self.wait(
            dist.irecv(msg, self.ranks[peer], group=self.group),
            f"receiving the {channel} handshake",
            peer,
        )
        msg = msg.cpu()
        nd = int(msg[0])
        if nd == _ERROR:
            return None
        shape = tuple(int(v) for v in msg[2 : 2 + nd])
        dtype = DTYPES[int(msg[1])]
        self._agree(channel, "recv", shape, dtype)
        return shape, dtype

    def _agree(
        self, channel: str, direction: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        self.meta[(channel, direction)] = (shape, dtype)
        # the gradient of an activation has its shape and dtype, in the other direction
        other = "grad" if channel == "act" else "act"
        self.meta[(other, "recv" if direction == "send" else "send")] = (shape, dtype)

    def _meta_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ data

    def _check(self, channel: str, mb: int, tensor: Tensor) -> None:
        agreed = self.meta.get((channel, "send"))
        peer = self.peer_stage(channel, "send")
        if agreed is None:
            raise ShapeAgreementError(
                f"{self.who(self.stage)} sends on the {channel} channel to {self.who(peer)} before "
                "the shapes were agreed; the pipeline's first step performs the handshake"
            )
        shape, dtype = agreed
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            what = "activation" if channel == "act" else "input gradient"
            raise ShapeAgreementError(
                f"{self.who(self.stage)} produced an {what} of {self.describe(tensor)} for "
                f"micro-batch {mb}, but {self.who(peer)} agreed to receive {shape} "
                f"{str(dtype).replace('torch.', '')} at the first step's handshake. Under "
                "transport='gloo'/'nccl' every micro-batch must have the shape of the first one "
                "(use equal batch sizes, e.g. drop_last=True, and keep stage outputs fixed)."
            )

    def send(self, channel: str, stage: int, mb: int, tensor: Any) -> None:
        if not isinstance(tensor, Tensor):
            raise PeerError(
                f"{self.who(self.stage)} has no tensor to send on the {channel} channel for "
                f"micro-batch {mb} (got {tensor!r}); distributed transports carry tensors only"
            )
        self._check(channel, mb, tensor)
        peer = self.ranks[self.peer_stage(channel, "send")]
        t = tensor.detach().contiguous()
        if self.backend == "gloo":
            work = dist.isend(t, peer, group=self.group)
        else:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.comm_stream):
                self.comm_stream.wait_event(ready)
                (work,) = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer, self.group)])
        earlier = self._sends.pop((channel, mb), None)
        if earlier is not None:  # a send of an earlier segment that nobody waited for
            self.wait(earlier[0], earlier[2])
        self._sends[(channel, mb)] = (work, t, f"sending the {channel} of micro-batch {mb}")
        if self.backend == "nccl":
            self._reap()

    def recv(self, channel: str, stage: int, mb: int, certain: int | None = None) -> Tensor:
        """The tensor of micro-batch ``mb`` on ``channel`` (blocking, at most ``timeout``).

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
        posted = self._posted.pop((channel, mb), None)
        if posted is None:
            posted = self._post(channel, mb, agreed, src)
        if certain is not None and self.backend == "gloo":
            # messages of one (peer, tag) match receives in posting order: post mb+1, mb+2, ...
            for ahead in range(mb + 1, min(certain, mb + 1 + self.prepost)):
                if (channel, ahead) not in self._posted:
                    self._posted[(channel, ahead)] = self._post(channel, ahead, agreed, src)
        work, buf = posted
        what = (
            f"receiving the {'activation' if channel == 'act' else 'gradient'} of micro-batch {mb}"
        )
        self.wait(work, what, src)
        if channel == "grad" and self.backend == "gloo":
            # the next stage received this micro-batch's activation before computing its
            # gradient: that send has completed, so waiting on it returns at once
            sent = self._sends.pop(("act", mb), None)
            if sent is not None:
                self.wait(sent[0], sent[2], self.peer_stage("act", "send"))
        return buf

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
                self.wait(sent[0], sent[2], peer)

    def _post(
        self, channel: str, mb: int, agreed: tuple[tuple[int, ...], torch.dtype], src: int
    ) -> tuple[Any, Tensor]:
        shape, dtype = agreed
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        if self.backend == "gloo":
            return dist.irecv(buf, self.ranks[src], group=self.group), buf
        with torch.cuda.stream(self.comm_stream):
            (work,) = dist.batch_isend_irecv(
                [dist.P2POp(dist.irecv, buf, self.ranks[src], self.group)]
            )
        # waited on from the compute stream: it waits (on the device) for the transfer
        return work, buf

    def _reap(self) -> None:
        """NCCL: forget sends that completed. Until then the transport holds each sent
        tensor, so the caching allocator cannot hand its memory to a new tensor while NCCL (on
        its own stream) still reads it. (gloo cannot be polled: see the module docstring.)"""
        self._sends = {k: s for k, s in self._sends.items() if not s[0].is_completed()}

    def wait_sends(self) -> None:
        """gloo: block until every send has left. NCCL: order the current stream after every
        send (device-side); tensors stay referenced until their work reports completion."""
        for work, _t, what in self._sends.values():
            self.wait(work, what)
        if self.backend == "gloo":
            self._sends.clear()  # every one was waited for
        else:
            self._reap()

    def close(self) -> None:
        self._sends.clear()
        self._posted.clear()
