"""The collectives the twin runs, each as what a rank gives every member and what it makes of
what every member gave it.

Every member sends every other member a frame for every collective (empty when it has nothing
for that member), so a collective completes on a rank only when every member has it running,
as a ring or tree algorithm needs. Reductions fold the members' tensors in group-rank order
(:func:`~engine.testing.nccl_twin.dtypes.fold`): the same bits on every rank and every run.
Inputs are copied when the collective starts running, as NCCL's kernel reads them then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.testing.nccl_twin.dtypes import check_tensor, fold, reduce_op, short
from engine.testing.nccl_twin.entries import Coll
from engine.testing.nccl_twin.errors import MismatchError

Got = list[list[torch.Tensor]]


def _once(make: Callable[[], list[torch.Tensor]]) -> Callable[[], list[torch.Tensor]]:
    cache: list[list[torch.Tensor]] = []

    def get() -> list[torch.Tensor]:
        if not cache:
            cache.append(make())
        return cache[0]

    return get


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    return check_tensor(t, what, collective=True).reshape(-1)


def _put(dst: torch.Tensor, src: torch.Tensor, name: str, source: int, me: int) -> None:
    if dst.numel() != src.numel() or dst.dtype != src.dtype:
        raise MismatchError(
            f"{name}: rank {me}'s output for group rank {source} is {short(dst)} but group rank "
            f"{source} gave {short(src)}"
        )
    dst.copy_(src.view(dst.shape))


def _single(tensors: Sequence[torch.Tensor], name: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(
            f"{name}: Expecting one tensor only but got {len(tensors)} (ProcessGroupNCCL takes "
            f"one tensor per process)"
        )
    return tensors[0]


def all_reduce(tensors: Sequence[torch.Tensor], op: object, n: int, name: str) -> Coll:
    complex_in = [t.is_complex() for t in tensors]
    flats = [_flat(t, f"{name} tensor {k}") for k, t in enumerate(tensors)]
    how = [reduce_op(op, f, name, c) for f, c in zip(flats, complex_in, strict=True)]
    mine = _once(lambda: [f.clone() for f in flats])

    def take(got: Got) -> None:
        for k, f in enumerate(flats):
            f.copy_(fold(how[k], [got[i][k] for i in range(n)]))

    sig = (name, tuple(how), tuple((f.numel(), str(f.dtype)) for f in flats))
    what = ", ".join(short(t) for t in tensors) + f" {how[0] if how else ''}"
    return Coll(name, sig, lambda j: mine(), take, list(tensors), what)


def broadcast(tensors: Sequence[torch.Tensor], root: int, n: int, me: int) -> Coll:
    t = _single(tensors, "broadcast")
    flat = _flat(t, "broadcast tensor")
    mine = _once(lambda: [flat.clone()] if me == root else [])

    def take(got: Got) -> None:
        if me != root:
            _put(flat, got[root][0], "broadcast", root, me)

    sig = ("broadcast", root, flat.numel(), str(flat.dtype))
    return Coll("broadcast", sig, lambda j: mine(), take, [t], f"{short(t)} from group rank {root}")


def all_gather(outs: Sequence[torch.Tensor], t: torch.Tensor, n: int, me: int, name: str) -> Coll:
    if len(outs) != n:
        raise ValueError(f"{name}: {len(outs)} output tensors for a group of {n}")
    flat = _flat(t, f"{name} input")
    out_flats = [_flat(o, f"{name} output {i}") for i, o in enumerate(outs)]
    mine = _once(lambda: [flat.clone()])

    def take(got: Got) -> None:
        for i in range(n):
            _put(out_flats[i], got[i][0], name, i, me)

    return Coll(name, (name, str(flat.dtype)), lambda j: mine(), take, list(outs), short(t))


def reduce_scatter(
    out: torch.Tensor, pieces: Sequence[torch.Tensor], op: object, n: int, me: int, name: str
) -> Coll:
    if len(pieces) != n:
        raise ValueError(f"{name}: {len(pieces)} input tensors for a group of {n}")
    flat = _flat(out, f"{name} output")
    flats = [_flat(p, f"{name} input {j}") for j, p in enumerate(pieces)]
    how = reduce_op(op, flat, name, out.is_complex())
    mine = _once(lambda: [f.clone() for f in flats])

    def take(got: Got) -> None:
        parts = [got[i][0] for i in range(n)]
        for i, p in enumerate(parts):
            if p.numel() != flat.numel() or p.dtype != flat.dtype:
                _put(flat, p, name, i, me)  # raises naming the rank
        flat.copy_(fold(how, parts))

    sig = (name, how, flat.numel(), str(flat.dtype))
    return Coll(name, sig, lambda j: [mine()[j]], take, [out], f"{short(out)} {how}")


def all_to_all(
    outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], n: int, me: int, name: str
) -> Coll:
    if len(outs) != n or len(ins) != n:
        raise ValueError(f"{name}: {len(ins)} inputs and {len(outs)} outputs for a group of {n}")
    flats = [_flat(t, f"{name} input {j}") for j, t in enumerate(ins)]
    out_flats = [_flat(o, f"{name} output {i}") for i, o in enumerate(outs)]
    mine = _once(lambda: [f.clone() for f in flats])

    def take(got: Got) -> None:
        for i in range(n):
            _put(out_flats[i], got[i][0], name, i, me)

    what = f"{len(ins)} x {short(ins[0])}" if ins else "nothing"
    return Coll(name, (name, str(flats[0].dtype)), lambda j: [mine()[j]], take, list(outs), what)


def barrier() -> Coll:
    return Coll("barrier", ("barrier",), lambda j: [], lambda got: None, [], "no data")


def reduce(tensors: Sequence[torch.Tensor], root: int, op: object, n: int, me: int) -> Coll:
    t = _single(tensors, "reduce")
    flat = _flat(t, "reduce tensor")
    how = reduce_op(op, flat, "reduce", t.is_complex())
    mine = _once(lambda: [flat.clone()])

    def take(got: Got) -> None:
        if me == root:
            flat.copy_(fold(how, [got[i][0] for i in range(n)]))

    sig = ("reduce", root, how, flat.numel(), str(flat.dtype))
    give: Callable[[int], list[torch.Tensor]] = lambda j: mine() if j == root else []  # noqa: E731
    return Coll("reduce", sig, give, take, [t], f"{short(t)} {how} to group rank {root}")


def gather(
    outs: Sequence[torch.Tensor], t: torch.Tensor, root: int, n: int, me: int
) -> Coll:
    if me == root and len(outs) != n:
        raise ValueError(f"gather: {len(outs)} output tensors on the root for a group of {n}")
    flat = _flat(t, "gather input")
    out_flats = [_flat(o, f"gather output {i}") for i, o in enumerate(outs)]
    mine = _once(lambda: [flat.clone()])

    def take(got: Got) -> None:
        if me == root:
            for i in range(n):
                _put(out_flats[i], got[i][0], "gather", i, me)

    give: Callable[[int], list[torch.Tensor]] = lambda j: mine() if j == root else []  # noqa: E731
    return Coll("gather", ("gather", root, str(flat.dtype)), give, take, list(outs), short(t))


def scatter(
    out: torch.Tensor, pieces: Sequence[torch.Tensor], root: int, n: int, me: int
) -> Coll:
    if me == root and len(pieces) != n:
        raise ValueError(f"scatter: {len(pieces)} input tensors on the root for a group of {n}")
    flat = _flat(out, "scatter output")
    flats = [_flat(p, f"scatter input {j}") for j, p in enumerate(pieces)]
    mine = _once(lambda: [f.clone() for f in flats])

    def take(got: Got) -> None:
        _put(flat, got[root][0], "scatter", root, me)

    give: Callable[[int], list[torch.Tensor]] = lambda j: [mine()[j]] if me == root else []  # noqa: E731
    return Coll("scatter", ("scatter", root, str(flat.dtype)), give, take, [out], short(out))


def combine(colls: Sequence[Coll], name: str, n: int) -> Coll:
    """Collectives that each give one tensor to every member, run as one NCCL group (the
    ``*_coalesced`` calls): one entry, one work."""

    def give(j: int) -> list[torch.Tensor]:
        out = []
        for c in colls:
            (t,) = c.give(j)
            out.append(t)
        return out

    def take(got: Got) -> None:
        for k, c in enumerate(colls):
            c.take([got[i][k : k + 1] for i in range(n)])

    sig = (name, *(c.signature for c in colls))
    outputs = [t for c in colls for t in c.outputs]
    return Coll(name, sig, give, take, outputs, "; ".join(c.what for c in colls))
