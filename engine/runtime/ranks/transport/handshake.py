"""The first step's shape agreement between neighbouring ranks (one half of P2PTransport).

Why apart from the data path: the handshake runs once per pipeline (and again only when a
stage fails its dry run), moves pickled Signatures with blocking waits, and fixes what every
later message is checked against; the data path (p2p.py) runs per micro-batch and never
pickles. Stage s announces the Signature of what it will send (:meth:`Handshake.send_meta`),
its neighbour receives it (:meth:`Handshake.recv_meta`); both record it as the agreed content
of the channel, and of the opposite channel's gradients (the leaves that require grad).
A header of -1 instead of a length says "my dry run failed": the receiver must not wait for
data.

Also here: the shapes of the micro-batches in flight across a save (:meth:`Handshake.wire_shapes`).
A gradient travels with the shapes its activation had, which both ends remember per
micro-batch; a rank resumed from an unflushed save has not seen those activations travel, so
the save keeps their leaf shapes (JSON, no pickle in a checkpoint) and the resumed rank turns
them back into Signatures once its own handshake has agreed the structure.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch import Tensor

from engine.runtime.ranks.transport.base import DTYPES
from engine.runtime.stage.trees import LeafMeta, Signature, unflatten

__all__ = ["Handshake"]

_ERROR = -1  # length of a meta message that says "the sender failed its dry run"


class Handshake:
    """The handshake methods of :class:`~engine.runtime.ranks.transport.p2p.P2PTransport` (which
    provides ``stage``, ``ranks``, ``meta``, ``who`` and ``wait``; each transport says how a
    metadata message travels: ``meta_send``/``meta_recv``, CPU tensors on the pipeline's
    gloo group or on NCCL's control plane)."""

    #: the dtypes this transport's messages can carry
    dtypes: tuple[torch.dtype, ...] = DTYPES
    stage: int
    ranks: list[int]
    name: str
    meta: dict[tuple[str, str], Signature]
    who: Any
    wait: Any
    wait_host: Any
    peer_stage: Any
    _sent_sigs: dict[int, Signature]
    _recv_sigs: dict[int, Signature]
    #: restored by :meth:`restore_wire_shapes`, until the handshake agrees the structure:
    #: direction ("send"|"recv") -> {micro-batch: leaf shapes}
    _pending_shapes: dict[str, dict[int, list[list[int]]]]

    def unsupported(self, tree: Any) -> str:
        """Why the tensors of ``tree`` cannot travel on this transport ("" when they can)."""
        for path, meta in Signature.of(tree).metas(grad=False):
            if meta.dtype not in self.dtypes:
                at = f"{path} " if path else ""
                return (
                    f"{self.who(self.stage)} would send {at}{meta.shape} {meta.dtype} to "
                    f"{self.who(self.stage + 1)} over {self.name}: supported dtypes are "
                    f"{[str(d).replace('torch.', '') for d in self.dtypes]}"
                )
        return ""

    def send_meta(self, channel: str, tree: Any | None) -> None:
        """Announce what this stage will send on ``channel``: the Signature of ``tree`` (a
        tensor or a tree of them; None: my dry run failed and the receiver must not wait for
        data)."""
        peer = self.peer_stage(channel, "send")
        payload = b""
        if tree is not None:
            sig = Signature.of(tree)
            payload = pickle.dumps(sig.skeleton)
            self._agree(channel, "send", sig)
        head = torch.tensor([len(payload) if tree is not None else _ERROR], dtype=torch.int64)
        works = [self.meta_send(head, peer)]
        if payload:
            works.append(self.meta_send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), peer))
        for work in works:
            self.wait_host(work, f"sending the {channel} handshake", peer)

    def recv_meta(self, channel: str) -> Signature | None:
        """Receive the peer's announcement on ``channel``; None if the peer failed."""
        peer = self.peer_stage(channel, "recv")
        head = torch.zeros(1, dtype=torch.int64)
        what = f"receiving the {channel} handshake"
        self.wait_host(self.meta_recv(head, peer), what, peer)
        n = int(head[0])
        if n == _ERROR:
            return None
        body = torch.empty(n, dtype=torch.uint8)
        self.wait_host(self.meta_recv(body, peer), what, peer)
        sig = Signature(pickle.loads(body.numpy().tobytes()))
        self._agree(channel, "recv", sig)
        return sig

    def _agree(self, channel: str, direction: str, sig: Signature) -> None:
        self.meta[(channel, direction)] = sig
        # the gradients of an activation go the other way: its leaves that require grad
        other = "grad" if channel == "act" else "act"
        self.meta[(other, "recv" if direction == "send" else "send")] = sig
        if channel == "act" and self._pending_shapes.get(direction):
            table = self._sent_sigs if direction == "send" else self._recv_sigs
            for mb, shapes in self._pending_shapes.pop(direction).items():
                table.setdefault(mb, _with_shapes(sig, shapes))

    def wire_shapes(self) -> dict[str, list[Any]]:
        """The leaf shapes of every activation this rank sent ("send") or received ("recv")
        whose gradient has not travelled back yet: JSON-able, for the in-flight state."""
        out: dict[str, list[Any]] = {}
        for direction, table in (("send", self._sent_sigs), ("recv", self._recv_sigs)):
            out[direction] = [
                [mb, [list(m.shape) for _, m in sig.metas(False)]] for mb, sig in sorted(table.items())
            ]
        return out

    def restore_wire_shapes(self, shapes: dict[str, list[Any]]) -> None:
        """Undo :meth:`wire_shapes` in a fresh transport (before its handshake)."""
        self._pending_shapes = {
            d: {int(mb): [list(s) for s in leaf] for mb, leaf in shapes.get(d, [])}
            for d in ("send", "recv")
        }

    def meta_send(self, t: Tensor, peer: int) -> Any:
        """Post the metadata message ``t`` (a CPU tensor) to stage ``peer``: its work."""
        raise NotImplementedError

    def meta_recv(self, buf: Tensor, peer: int) -> Any:
        """Post the receive of a metadata message from stage ``peer`` into ``buf``: its work."""
        raise NotImplementedError


def _with_shapes(sig: Signature, shapes: list[list[int]]) -> Signature:
    """``sig`` with its tensor leaves' shapes replaced by ``shapes`` (in leaf order)."""
    leaves = list(sig.leaves)
    if len(shapes) != len(sig.tensor_at):
        raise ValueError(f"{len(shapes)} saved leaf shapes for {len(sig.tensor_at)} tensor leaves")
    for i, shape in zip(sig.tensor_at, shapes, strict=True):
        m = leaves[i]
        leaves[i] = LeafMeta(tuple(int(d) for d in shape), m.dtype, m.requires_grad)
    return Signature(unflatten(leaves, sig.spec))
