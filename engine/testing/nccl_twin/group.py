"""The process group torch.distributed holds for a twin group: torch's API mapped onto the hub.

A Python subclass of ``torch.distributed.ProcessGroup`` (torch's C++ ``Backend`` cannot be
subclassed from Python): ``dist.isend``/``dist.irecv``/``send``/``recv`` reach :meth:`send` and
:meth:`recv` (an unbatched op: its pair's 2-rank communicator, as ProcessGroupNCCL makes one),
collectives reach the methods of the same names, functional collectives (DTensor) reach them
through torch's C++ trampoline, and ``dist.batch_isend_irecv`` reaches :meth:`post_batch`
through the twin's wrapper (the group's communicator, one entry).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from engine.op_label import OP_LABEL
from engine.testing.nccl_twin import collectives as C
from engine.testing.nccl_twin.dtypes import check_tensor
from engine.testing.nccl_twin.entries import GroupInfo
from engine.testing.nccl_twin.hub import Hub, Spec
from engine.testing.nccl_twin.work import TwinWork

BACKEND = "nccl_twin"


def _one(tensors: Sequence[torch.Tensor], name: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(
            f"{name}: Expecting one tensor only but got {len(tensors)} (ProcessGroupNCCL "
            f"takes one tensor per process)"
        )
    return tensors[0]


def _splits(t: torch.Tensor, sizes: Sequence[int], n: int, what: str) -> list[torch.Tensor]:
    """``t`` cut along dim 0 into ``sizes`` rows (equal parts when ``sizes`` is empty)."""
    rows = t.shape[0] if t.dim() else 1
    if not sizes:
        if rows % n:
            raise ValueError(f"all_to_all_single: {what} has {rows} rows, not divisible by {n}")
        sizes = [rows // n] * n
    if len(sizes) != n or sum(sizes) != rows:
        raise ValueError(f"all_to_all_single: {what} split sizes {list(sizes)} do not cut {rows} rows into {n}")
    out, at = [], 0
    for k in sizes:
        out.append(t.narrow(0, at, k))
        at += k
    return out


class TwinProcessGroup(dist.ProcessGroup):
    """One process group on the NCCL twin (see ``engine.testing.nccl_twin``)."""

    def __init__(self, hub: Hub, info: GroupInfo) -> None:
        super().__init__(info.me, len(info.ranks))
        self.hub, self.info = hub, info
        self.name_, self.desc_ = info.name, ""

    # torch reads a Python group's name and backend through these (functional collectives too)
    def getBackendName(self) -> str:
        return BACKEND

    def getGroupName(self) -> str:
        return self.name_

    def setGroupName(self, name: str) -> None:
        self.name_ = name

    def getGroupDesc(self) -> str:
        return self.desc_

    def setGroupDesc(self, desc: str) -> None:
        self.desc_ = desc

    def __repr__(self) -> str:
        return f"TwinProcessGroup({self.info.title}, rank {self.info.me})"

    # ------------------------------------------------------------------ point to point

    def _p2p(self, kind: str, tensors: Sequence[torch.Tensor], peer: int) -> TwinWork:
        t = _one(tensors, kind)
        spec: Spec = (kind, check_tensor(t, f"{kind} tensor", collective=False), t, peer)
        return self.hub.post_p2p(self.info, [spec], batched=False, label=OP_LABEL.get())

    def send(self, tensors: Sequence[torch.Tensor], dstRank: int, tag: int = 0) -> TwinWork:  # noqa: N803
        return self._p2p("send", tensors, dstRank)

    def recv(self, tensors: Sequence[torch.Tensor], srcRank: int, tag: int = 0) -> TwinWork:  # noqa: N803
        return self._p2p("recv", tensors, srcRank)

    def recv_anysource(self, tensors: Sequence[torch.Tensor], tag: int = 0) -> TwinWork:
        raise RuntimeError("ProcessGroupNCCL does not support recvAnysource: recv() needs a src")

    def post_batch(self, p2p_ops: Sequence[dist.P2POp]) -> list[TwinWork]:
        """A ``batch_isend_irecv`` list as one entry on the group's communicator; like
        ProcessGroupNCCL, one work for the whole list."""
        specs: list[Spec] = []
        for op in p2p_ops:
            kind = {"isend": "send", "irecv": "recv"}.get(getattr(op.op, "__name__", ""))
            if kind is None:
                raise ValueError(f"batch_isend_irecv takes dist.isend and dist.irecv ops, got {op.op!r}")
            what = f"batch_isend_irecv {kind} tensor"
            specs.append((kind, check_tensor(op.tensor, what, collective=False), op.tensor, op.group_peer))
        return [self.hub.post_p2p(self.info, specs, batched=True, label=OP_LABEL.get())]

    # ------------------------------------------------------------------ collectives

    @property
    def _n(self) -> int:
        return len(self.info.ranks)

    def _post(self, coll: C.Coll) -> TwinWork:
        return self.hub.post_coll(self.info, coll, OP_LABEL.get())

    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> TwinWork:
        op = (opts or dist.AllreduceOptions()).reduceOp
        return self._post(C.all_reduce([_one(tensors, "all_reduce")], op, self._n, "all_reduce"))

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> TwinWork:
        op = (opts or dist.AllreduceCoalescedOptions()).reduceOp
        return self._post(C.all_reduce(list(tensors), op, self._n, "all_reduce_coalesced"))

    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> TwinWork:
        opts = opts or dist.BroadcastOptions()
        root = opts.rootRank + opts.rootTensor
        return self._post(C.broadcast(tensors, root, self._n, self.info.me))

    def allgather(self, outs: Sequence[Sequence[torch.Tensor]], ins: Sequence[torch.Tensor],
                  opts: Any = None) -> TwinWork:
        t = _one(ins, "all_gather")
        return self._post(C.all_gather(_one(outs, "all_gather"), t, self._n, self.info.me, "all_gather"))  # type: ignore[arg-type]

    def _gather_into(self, out: torch.Tensor, inp: torch.Tensor, name: str) -> C.Coll:
        if out.numel() != self._n * inp.numel():
            raise ValueError(
                f"{name}: output tensor size must be equal to world_size times input tensor "
                f"size ({out.numel()} != {self._n} x {inp.numel()})")
        check_tensor(out, f"{name} output", collective=True)
        return C.all_gather(list(out.reshape(-1).chunk(self._n)), inp, self._n, self.info.me, name)

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> TwinWork:
        return self._post(self._gather_into(out, inp, "all_gather_into_tensor"))

    def all_gather_single_coalesced(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor],
                                    opts: Any = None) -> TwinWork:
        name = "all_gather_into_tensor_coalesced"
        colls = [self._gather_into(o, i, name) for o, i in zip(outs, ins, strict=True)]
        return self._post(C.combine(colls, name, self._n))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # torch's older name

    def reduce_scatter(self, outs: Sequence[torch.Tensor], ins: Sequence[Sequence[torch.Tensor]],
                       opts: Any = None) -> TwinWork:
        op = (opts or dist.ReduceScatterOptions()).reduceOp
        out, pieces = _one(outs, "reduce_scatter"), _one(ins, "reduce_scatter")  # type: ignore[arg-type]
        return self._post(C.reduce_scatter(out, pieces, op, self._n, self.info.me, "reduce_scatter"))

    def _scatter_into(self, out: torch.Tensor, inp: torch.Tensor, op: object, name: str) -> C.Coll:
        if inp.numel() != self._n * out.numel():
            raise ValueError(
                f"{name}: input tensor size must be equal to world_size times output tensor "
                f"size ({inp.numel()} != {self._n} x {out.numel()})")
        check_tensor(inp, f"{name} input", collective=True)
        pieces = list(inp.reshape(-1).chunk(self._n))
        return C.reduce_scatter(out, pieces, op, self._n, self.info.me, name)

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> TwinWork:
        op = (opts or dist.ReduceScatterOptions()).reduceOp
        return self._post(self._scatter_into(out, inp, op, "reduce_scatter_tensor"))

    def reduce_scatter_single_coalesced(self, outs: Sequence[torch.Tensor],
                                        ins: Sequence[torch.Tensor], opts: Any = None) -> TwinWork:
        op = (opts or dist.ReduceScatterOptions()).reduceOp
        name = "reduce_scatter_tensor_coalesced"
        colls = [self._scatter_into(o, i, op, name) for o, i in zip(outs, ins, strict=True)]
        return self._post(C.combine(colls, name, self._n))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # torch's older name

    def alltoall(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor],
                 opts: Any = None) -> TwinWork:
        return self._post(C.all_to_all(outs, ins, self._n, self.info.me, "all_to_all"))

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                          in_splits: Sequence[int], opts: Any = None) -> TwinWork:
        for t, what in ((out, "output"), (inp, "input")):
            check_tensor(t, f"all_to_all_single {what}", collective=True)
        outs = _splits(out, out_splits, self._n, "output")
        ins = _splits(inp, in_splits, self._n, "input")
        return self._post(C.all_to_all(outs, ins, self._n, self.info.me, "all_to_all_single"))

    alltoall_base = all_to_all_single  # torch's older name

    def barrier(self, opts: Any = None) -> TwinWork:
        return self._post(C.barrier())

    def reduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> TwinWork:
        opts = opts or dist.ReduceOptions()
        root = opts.rootRank + opts.rootTensor
        return self._post(C.reduce(tensors, root, opts.reduceOp, self._n, self.info.me))

    def gather(self, outs: Sequence[Sequence[torch.Tensor]], ins: Sequence[torch.Tensor],
               opts: Any = None) -> TwinWork:
        root = (opts or dist.GatherOptions()).rootRank
        mine = list(outs[0]) if outs else []
        return self._post(C.gather(mine, _one(ins, "gather"), root, self._n, self.info.me))

    def scatter(self, outs: Sequence[torch.Tensor], ins: Sequence[Sequence[torch.Tensor]],
                opts: Any = None) -> TwinWork:
        root = (opts or dist.ScatterOptions()).rootRank
        pieces = list(ins[0]) if ins else []
        return self._post(C.scatter(_one(outs, "scatter"), pieces, root, self._n, self.info.me))

    def start_coalescing(self, device: torch.device) -> None:
        raise NotImplementedError(
            "the NCCL twin does not model torch's _coalescing_manager; post point-to-point "
            "ops that run together with dist.batch_isend_irecv"
        )

    def end_coalescing(self, device: torch.device) -> TwinWork:
        self.start_coalescing(device)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ ending

    def abort(self) -> None:
        self.hub.close_group(self.info, "aborted (pg.abort())")

    def shutdown(self) -> None:
        self.hub.close_group(self.info, "shut down (destroy_process_group or pg.shutdown())")
