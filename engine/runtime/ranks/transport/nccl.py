"""The NCCL transport: GPU tensors between processes, built against NCCL's rules.

NCCL's rules, which this module is designed against (engine.testing.nccl_twin enforces them
on the CPU, so the default test run executes this code):

1. every communicator runs its operations strictly in posting order, one queue per rank;
2. a send may block until its receive runs (only small messages are buffered);
3. there are no tags: messages match by order per communicator and pair of ranks;
4. both ends must post equal sizes and dtypes;
5. the operations of one group (``batch_isend_irecv``) progress together.

How the transport keeps them, by construction:

* **One communicator per channel direction and boundary** (layout.ChannelGroups): a
  communicator then carries messages one way only, posted by the sender and by the receiver
  each in micro-batch order, so its queue never holds a send ahead of a receive the peer
  needs first. With one communicator per pair of ranks, 1F1B's steady state -- stage s sends
  activation i+1 then receives gradient i, while stage s+1 sends gradient i then receives
  activation i+1 -- deadlocks as soon as messages are too large to be buffered.
  torch.distributed.pipelining fuses each action's sends and receives into one batch
  instead, which needs the actions regrouped per rank; direction communicators make any
  valid action order safe as it is, for 2(S-1) two-rank communicators per pipeline.
* **Every op on the caller's (compute) stream**: ProcessGroupNCCL makes its NCCL stream wait
  for the current stream when an op is posted, and the current stream wait for the op at
  ``work.wait()``. So a send leaves after the kernels that produced it; a receive's buffer,
  just allocated on the compute stream, is written only after every kernel queued before it
  (a block the allocator recycled from a tensor those kernels still read is safe); and the
  transfer still overlaps later compute on the NCCL stream. The engine keeps no stream of
  its own for communication.
* **One batch per message**: an activation's leaves, or a gradient's leaves and trailers,
  are one ``batch_isend_irecv`` (one NCCL group, one kernel).
* **No host read per message** while shapes stay as agreed: an activation is its leaves
  alone. The first stage knows before a step which of its micro-batches have other input
  shapes than the one before, and tells every rank in a per-step notice on the control plane
  (shape_notice.py). Only those micro-batches' activations travel with a header -- a host
  message on the control plane (0: the previous activation's shapes; n > 0: a new Signature
  of n bytes follows), so not even then does the device synchronise. An unannounced
  activation whose shapes differ from the agreed ones (shapes that depend on the data, not
  only on the input's shapes) is refused with an error naming the stage, unless the pipeline
  was built with ``activation_shapes="any"``: then every activation's header travels first
  (one host message each, still no device synchronisation).
* **Sends held until complete**: each sent tensor stays referenced until its work reports
  completion (polled), so the caching allocator never recycles a buffer NCCL still reads.
* **Nothing pending across a step boundary**: the rank's lane receives, at the end of each
  asynchronous step, every message its neighbours sent in that step that it has not
  received yet, and keeps it for the next step's RF/RB (lane.py). NCCL's watchdog counts
  from enqueue, so a send left unmatched across a pause (evaluation, a checkpoint, data
  loading) longer than the timeout would end the job.
* **Failures without in-band marks**: a stage that raises inside a step runs the rest of its
  communication, sending zeros of the agreed shapes in place of what it owes (zeros: any
  index is in range); the step's verdict on the control plane tells every rank. Reading a
  mark on each message would be a device synchronisation per message.

Host messages (handshake, headers, notices, loss, verdicts) never use NCCL: control.py.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engine.errors import PipelineInputError
from engine.op_label import labelled
from engine.runtime.ranks.transport.base import NCCL_DTYPES, PeerError
from engine.runtime.ranks.transport.control import HANDSHAKE_TAG, SHAPE_TAG
from engine.runtime.ranks.transport.p2p import P2PTransport
from engine.runtime.ranks.transport.trailers import take_trailers, trailer_buffers
from engine.runtime.stage.trees import Signature

__all__ = ["NCCLTransport"]


class NCCLTransport(P2PTransport):
    """Point-to-point messages of one stage over NCCL (module docstring).

    Args:
        stage: the stage this process runs (a virtual stage: its index among all stages).
        ranks: global rank of every stage of this process's pipeline.
        groups: ``(channel, boundary) -> group`` for this stage's boundaries
            (layout.ChannelGroups).
        control: the pipeline's control-plane calls (a GroupCalls on its gloo group).
        device: this rank's GPU (the CPU under the twin).
        timeout: seconds a host wait on the control plane may take.
    """

    backend = "nccl"
    dtypes = NCCL_DTYPES

    def __init__(
        self, stage: int, ranks: list[int], groups: dict[tuple[str, int], Any], control: Any,
        device: torch.device, timeout: float,
    ) -> None:
        super().__init__(stage, ranks, device, timeout)
        self.groups = dict(groups)
        self.control = control
        self.group = None  # (no group of its own carries both directions)
        #: the rank's shape notices (shape_notice.py): which activations carry a header
        self.notices: Any = None
        #: Pipeline(activation_shapes="any"): every activation carries a header (shapes may
        #: depend on the data, not only on the first stage's input shapes)
        self.every_header = False
        #: set by the lane while it completes an aborted step's communication: new shapes
        #: are taken without the acceptance check
        self.aborting = False
        #: control-plane header messages in flight: (work, tensor kept alive)
        self._shape_sends: list[tuple[Any, Tensor]] = []

    # ------------------------------------------------------------------ plumbing

    def _group(self, channel: str, direction: str) -> Any:
        boundary = self.stage if (channel == "act") == (direction == "send") else self.stage - 1
        try:
            return self.groups[(channel, boundary)]
        except KeyError:
            raise ValueError(
                f"{self.who(self.stage)} has no {channel} channel to {direction} on (boundary "
                f"{boundary})"
            ) from None

    def wait(self, work: Any, what: str, peer: int | None = None) -> None:
        """Order the caller's stream after ``work`` (no host wait under NCCL: a timeout
        there would make ``wait`` block the host). The process group's own timeout (its
        watchdog) bounds a transfer that never completes."""
        try:
            work.wait()
        except Exception as exc:
            raise self.peer_error(exc, what, peer) from exc

    def meta_send(self, t: Tensor, peer: int) -> Any:
        return self.control.send(t, self.ranks[peer], HANDSHAKE_TAG)

    def meta_recv(self, buf: Tensor, peer: int) -> Any:
        return self.control.recv(buf, self.ranks[peer], HANDSHAKE_TAG)

    def _post(self, ops: list[Any], what: str, peer: int, label: str) -> list[Any]:
        """One batch (an NCCL group) of ``ops``, labelled for deadlock reports and profilers
        (engine.op_label)."""
        if not ops:
            return []
        try:
            with labelled(label):
                return dist.batch_isend_irecv(ops)
        except RuntimeError as exc:  # a broken communicator, a refused dtype
            raise self.peer_error(exc, what, peer) from exc

    def _header(self, mb: int) -> bool:
        return self.every_header or (self.notices is not None and self.notices.header(mb))

    # ------------------------------------------------------------------ sending

    def send(
        self, channel: str, stage: int, mb: int, value: Any, flag: Tensor | None = None,
        scale: Tensor | None = None,
    ) -> None:
        tensors, new = self._outgoing(channel, mb, value, flag, scale)
        if tensors is None:
            return  # no leaf carries a gradient: nothing travels
        if channel == "act":
            self._send_shapes(mb, new)
        peer = self.peer_stage(channel, "send")
        ts = [t.detach().contiguous() for t in tensors]
        group, dst = self._group(channel, "send"), self.ranks[peer]
        what = f"sending the {channel} of micro-batch {mb}"
        label = f"{channel} mb {mb} stage {self.stage}->{peer}"
        works = self._post([dist.P2POp(dist.isend, t, dst, group) for t in ts], what, peer, label)
        self._sends[(channel, mb)] = (works, ts, what)
        self._reap()

    def _send_shapes(self, mb: int, new: Signature | None) -> None:
        """Before activation ``mb`` leaves: its header on the control plane when the notice
        says its shapes may have changed; otherwise its shapes must be the agreed ones."""
        agreed = self.meta[("act", "send")]
        if not self._header(mb):
            if new is not None:
                raise PipelineInputError(
                    f"{self.who(self.stage)}'s output for micro-batch {mb} has shapes "
                    f"{agreed.changes(new)}, though the first stage's input shapes did not "
                    "change for this micro-batch: under transport='nccl' a stage's output "
                    "shapes must follow from its input shapes (activations travel without a "
                    "header while the input shapes stay the same). Pass "
                    "Pipeline(activation_shapes='any') when shapes depend on the data (each "
                    "activation's shapes then travel first, as a host message), or make the "
                    "stage's output shape independent of the data (pad it)."
                )
            self._sent_sigs[mb] = agreed
            return
        body = b""
        if new is not None:
            body = pickle.dumps(new.skeleton)
            self._agree("act", "send", new)
            self.shape_changes += 1
        self._sent_sigs[mb] = self.meta[("act", "send")]
        dst = self.ranks[self.stage + 1]
        msgs = [torch.tensor([len(body)], dtype=torch.int64)]
        if body:
            msgs.append(torch.frombuffer(bytearray(body), dtype=torch.uint8))
        for t in msgs:
            try:
                self._shape_sends.append((self.control.send(t, dst, SHAPE_TAG), t))
            except RuntimeError as exc:
                raise self.peer_error(exc, "sending an activation's shapes", self.stage + 1) from exc

    def send_abort(self, channel: str, stage: int, mb: int, text: str, dropped: bool = False) -> None:
        """Zeros of the agreed shapes in place of micro-batch ``mb``'s message on ``channel``
        (a step that aborts: module docstring). ``text`` travels on the control plane with
        the step's verdict instead."""
        if channel == "grad":
            agreed = self._recv_sigs.get(mb, self.meta[("grad", "send")])
            grads = [torch.zeros(m.shape, dtype=m.dtype, device=self.device) for _, m in agreed.metas(True)]
            flag = torch.zeros(1, dtype=torch.float32, device=self.device) if self.flags else None
            scale = torch.ones(1, dtype=torch.float32, device=self.device) if self.scales else None
            self.send("grad", stage, mb, grads if not agreed.single else (grads[0] if grads else None),
                      flag, scale)
            return
        agreed = self.meta[("act", "send")]
        zeros = [torch.zeros(m.shape, dtype=m.dtype, device=self.device) for _, m in agreed.metas(False)]
        self.send("act", stage, mb, agreed.build(zeros))

    def poison(self, message: str) -> None:
        """Errors travel on the control plane (the notice, the step's verdict), not in band."""

    # ------------------------------------------------------------------ receiving

    def recv(self, channel: str, stage: int, mb: int, certain: int | None = None) -> Any:
        """The tensor (or tree; or the gradients of a tree's leaves that require grad) of
        micro-batch ``mb`` on ``channel``: posted now, the caller's stream ordered after it."""
        src = self.peer_stage(channel, "recv")
        agreed = self._agreed_recv(channel, mb)
        if channel == "grad" and self._no_gradient(agreed):
            return None if agreed.single else []
        refused = ""
        if channel == "act":
            agreed, refused = self._recv_shapes(mb, src, agreed)
            self._recv_sigs[mb] = agreed
        metas = agreed.metas(grad=channel == "grad")
        bufs = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for _, m in metas]
        if channel == "grad":
            bufs += trailer_buffers(self)
        name = "activation" if channel == "act" else "gradient"
        what = f"receiving the {name} of micro-batch {mb}"
        group, peer = self._group(channel, "recv"), self.ranks[src]
        label = f"{channel} mb {mb} stage {src}->{self.stage}"
        works = self._post([dist.P2POp(dist.irecv, b, peer, group) for b in bufs], what, src, label)
        self._wait_all(works, what, src)
        if refused:  # received all the same: the communicator stays in step
            raise PipelineInputError(refused)
        if channel == "grad":
            bufs = take_trailers(bufs, mb, self)
            if not bufs:  # no leaf carries a gradient (the flag came alone)
                return None if agreed.single else []
            return bufs[0] if agreed.single else bufs
        return agreed.build(bufs)

    def _recv_shapes(self, mb: int, src: int, agreed: Signature) -> tuple[Signature, str]:
        """The Signature activation ``mb`` arrives with (its header, when the notice flagged
        it), and why this stage refuses its new shapes ("" when it takes them)."""
        if not self._header(mb):
            return agreed, ""
        what = f"receiving the shapes of micro-batch {mb}'s activation"
        peer = self.ranks[src]
        head = torch.zeros(1, dtype=torch.int64)
        self.wait_host(self.control.recv(head, peer, SHAPE_TAG), what, src)
        n = int(head[0])
        if n == 0:
            return agreed, ""
        if n < 0:
            raise PeerError(
                f"{self.who(self.stage)}: micro-batch {mb}'s shape header from {self.who(src)} "
                f"is {n}: the two ranks disagree on the transport protocol (same engine version?)"
            )
        body = torch.empty(n, dtype=torch.uint8)
        self.wait_host(self.control.recv(body, peer, SHAPE_TAG), what, src)
        sig = Signature(pickle.loads(body.numpy().tobytes()))
        problem = ""
        if not self.aborting and self.accept is not None:
            problem = self.accept(agreed, sig, mb)
        self._agree("act", "recv", sig)
        return sig, problem

    # ------------------------------------------------------------------ completion

    def _reap(self) -> None:
        """Forget sends that completed. Until then the transport holds each sent tensor, so
        the caching allocator cannot hand its memory to a new tensor while NCCL (on its own
        stream) still reads it."""
        self._sends = {
            k: s for k, s in self._sends.items() if not all(w.is_completed() for w in s[0])
        }

    def release(self, channel: str, mbs: list[int]) -> None:
        """NCCL forgets sends by polling their completion (:meth:`_reap`)."""

    def wait_sends(self) -> None:
        """The end of a synchronous step or a flush: the headers sent on the control plane
        have left (a host wait; their receivers post them within the same step), the
        caller's stream is ordered after every send (no host wait: a stream-side
        ``work.wait()``; their receivers posted them in the same step), and completed
        sends are forgotten."""
        for work, _t in self._shape_sends:
            self.wait_host(work, "sending an activation's shapes", self.stage + 1)
        self._shape_sends.clear()
        for works, _t, what in self._sends.values():
            self._wait_all(works, what)
        self._reap()

    def held(self) -> int:
        return super().held() + len(self._shape_sends)

    def settle_for_exit(self) -> None:
        from engine.runtime.ranks.transport.teardown import settle

        settle([w for w, _t in self._shape_sends])
        super().settle_for_exit()

    def close(self) -> None:
        self._shape_sends.clear()
        self.groups.clear()
        self.control = None
        super().close()
