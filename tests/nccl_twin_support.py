"""What each rank runs for tests/testing/test_nccl_twin.py: cases on the NCCL twin, one spawn.

Four ranks; the two-rank scenarios run on the pairs (0, 1) and (2, 3) at once, each case on
fresh groups (a deadlock or a timeout aborts its communicators). Ranks are in step between
cases through a gloo group. The deadlock limit is short (``DEADLOCK_S``) so the deadlock cases
cost seconds. The last case ends the odd ranks' processes on purpose.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from distributed_support import free_port, run_ranks

WORLD = 4
DEADLOCK_S = 1.5
Ctx = dict[str, Any]


def peer_of(rank: int) -> int:
    return rank ^ 1


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """What ``fn()`` did: its value, or the type and text of what it raised, and how long."""
    t0 = time.perf_counter()
    try:
        value = fn()
        return {"raised": None, "value": value, "seconds": time.perf_counter() - t0}
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc),
                "seconds": time.perf_counter() - t0}


def fresh(timeout: float = 30.0) -> dist.ProcessGroup:
    """A new twin group of every rank (its own communicators)."""
    return dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=timeout))


def inputs(rank: int, dtype: torch.dtype, n: int = 64) -> torch.Tensor:
    """Rank ``rank``'s input: floats spread over 16 decades (their sum depends on the order),
    small integers (their product does not overflow)."""
    g = torch.Generator().manual_seed(100 + rank)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-8, 8, n,
                dtype=torch.float64)).to(dtype)
    return torch.randint(-3, 4, (n,), generator=g, dtype=dtype)


# ---------------------------------------------------------------------- ordering cases


def case_lone_isends(rank: int, ctx: Ctx) -> dict[str, Any]:
    from engine.op_label import labelled

    g, peer = fresh(), peer_of(rank)
    a, b = torch.full((3,), float(rank)), torch.zeros(3)
    with labelled(f"act mb {rank}"):
        s = dist.isend(a, peer, group=g)
    r = dist.irecv(b, peer, group=g)
    polled = s.is_completed()  # before the report: still pending
    return outcome(r.wait) | {
        "send": outcome(s.wait), "polled": polled, "completed": s.is_completed(),
        "exception": type(s.exception()).__name__, "future": outcome(lambda: s.get_future().wait()),
    }


def case_lone_batches(rank: int, ctx: Ctx) -> dict[str, Any]:
    g, peer = fresh(), peer_of(rank)
    a, b = torch.full((3,), float(rank)), torch.zeros(3)
    sends = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer, g)])
    recvs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, peer, g)])
    return outcome(recvs[0].wait) | {"works": (len(sends), len(recvs))}


def case_fused(rank: int, ctx: Ctx) -> dict[str, Any]:
    g, peer = fresh(), peer_of(rank)
    a1, a2 = torch.arange(3.0) + 10 * rank, torch.arange(5.0) + 100 * rank
    b1, b2 = torch.zeros(3), torch.zeros(5)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, a1, peer, g), dist.P2POp(dist.isend, a2, peer, g),
        dist.P2POp(dist.irecv, b1, peer, g), dist.P2POp(dist.irecv, b2, peer, g),
    ])
    for w in works:
        w.wait()
    done = works[0]
    return {"works": len(works), "b1": b1, "b2": b2, "future": done.get_future().wait(),
            "completed": done.is_completed(), "exception": done.exception()}


def case_two_groups(rank: int, ctx: Ctx) -> dict[str, Any]:
    g1, g2, peer = fresh(), fresh(), peer_of(rank)
    mine, theirs = (g1, g2) if rank % 2 == 0 else (g2, g1)  # my send's group, my receive's
    a, b = torch.full((2,), float(rank)), torch.zeros(2)
    (s,) = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer, mine)])
    (r,) = dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, peer, theirs)])
    return outcome(lambda: (r.wait(), s.wait(), b)[2])


def case_cross_comm(rank: int, ctx: Ctx) -> dict[str, Any]:
    g1, g2, peer = fresh(), fresh(), peer_of(rank)
    t = torch.zeros(2)
    w = dist.isend(t, peer, group=g1) if rank % 2 == 0 else dist.irecv(t, peer, group=g2)
    return outcome(w.wait)


def case_coll_behind_send(rank: int, ctx: Ctx) -> dict[str, Any]:
    g, peer = fresh(), peer_of(rank)
    x = torch.tensor([float(rank)])
    if rank % 2 == 0:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), peer, g)])
    return outcome(lambda: dist.all_reduce(x, group=g))


def case_coll_other_group(rank: int, ctx: Ctx) -> dict[str, Any]:
    g1, g2, peer = fresh(), fresh(), peer_of(rank)
    x, b = torch.tensor([float(rank)]), torch.zeros(2)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        if rank % 2 == 0:
            (s,) = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), 7.0), peer, g1)])
            dist.all_reduce(x, group=g2)
            s.wait()
        else:
            dist.all_reduce(x, group=g2)
            (r,) = dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, peer, g1)])
            r.wait()
        return x, b

    return outcome(run)


def case_tags(rank: int, ctx: Ctx) -> dict[str, Any]:
    g, peer = fresh(), peer_of(rank)
    if rank % 2 == 0:
        works = [dist.isend(torch.full((2,), 5.0), peer, group=g, tag=5),
                 dist.isend(torch.full((2,), 3.0), peer, group=g, tag=3)]
        got: list[torch.Tensor] = []
    else:
        got = [torch.zeros(2), torch.zeros(2)]
        works = [dist.irecv(got[0], peer, group=g, tag=3), dist.irecv(got[1], peer, group=g, tag=5)]
    return outcome(lambda: ([w.wait() for w in works], got)[1])


def case_mismatch(rank: int, ctx: Ctx) -> dict[str, Any]:
    peer, out = peer_of(rank), {}
    for what, theirs in (("size", torch.zeros(5)), ("dtype", torch.zeros(4, dtype=torch.int32))):
        g = fresh()
        w = (dist.isend(torch.zeros(4), peer, group=g) if rank % 2 == 0
             else dist.irecv(theirs, peer, group=g))
        out[what] = outcome(w.wait)
    return out


def case_dtypes(rank: int, ctx: Ctx) -> dict[str, Any]:
    g, peer = fresh(), peer_of(rank)
    out = {
        "int16 isend": outcome(lambda: dist.isend(torch.zeros(2, dtype=torch.int16), peer, group=g)),
        "int16 all_reduce": outcome(
            lambda: dist.all_reduce(torch.zeros(2, dtype=torch.int16), group=g)),
        "non-contiguous": outcome(lambda: dist.all_reduce(torch.zeros(4, 4).t(), group=g)),
        "BAND": outcome(lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64),
                                                op=dist.ReduceOp.BAND, group=g)),
        "bool AVG": outcome(lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool),
                                                    op=dist.ReduceOp.AVG, group=g)),
    }
    bools = torch.tensor([rank == 0, False, True, rank == 3])
    dist.all_reduce(bools, group=g)
    bsend, brecv = torch.tensor([True, False, rank % 2 == 0]), torch.zeros(3, dtype=torch.bool)
    csend = torch.complex(torch.arange(3.0) + rank, -torch.arange(3.0))
    crecv = torch.zeros(3, dtype=torch.complex64)
    for w in dist.batch_isend_irecv([
        dist.P2POp(dist.isend, bsend, peer, g), dist.P2POp(dist.irecv, brecv, peer, g),
        dist.P2POp(dist.isend, csend, peer, g), dist.P2POp(dist.irecv, crecv, peer, g),
    ]):
        w.wait()
    csum = torch.complex(torch.tensor([1.0 * rank]), torch.tensor([2.0]))
    dist.all_reduce(csum, group=g)
    return out | {"bool or": bools, "bool recv": brecv, "complex recv": crecv, "complex sum": csum}


def case_alone(rank: int, ctx: Ctx) -> dict[str, Any]:
    """A one-rank group: its collectives need nobody; a list sending to itself completes."""
    mine = [dist.new_group([q]) for q in range(WORLD)][rank]
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=mine)
    a, b = torch.arange(4.0) + rank, torch.zeros(4)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, rank, mine),
                                     dist.P2POp(dist.irecv, b, rank, mine)]):
        w.wait()
    return {"sum": t, "b": b}


# ---------------------------------------------------------------------- failures


def case_timeout(rank: int, ctx: Ctx) -> dict[str, Any]:
    g, g2, peer = fresh(timeout=1.5), fresh(), peer_of(rank)
    if rank % 2:
        time.sleep(3.0)  # awake, not waiting on the twin: a timeout, not a deadlock
        return {}
    b = torch.zeros(2)
    w = dist.irecv(b, peer, group=g)
    group_timeout = outcome(w.wait)
    w2 = dist.irecv(b, peer, group=g2)
    wait_timeout = outcome(lambda: w2.wait(timeout=datetime.timedelta(seconds=0.5)))
    return {"group": group_timeout, "wait": wait_timeout}


def case_abort(rank: int, ctx: Ctx) -> dict[str, Any]:
    g, peer = fresh(), peer_of(rank)
    b = torch.zeros(2)
    w = dist.irecv(b, peer, group=g)
    if rank % 2:
        return {"peer": outcome(w.wait)}
    time.sleep(0.3)  # the peer is waiting by now
    g.abort()
    own = outcome(w.wait)
    return {"own": own, "after": outcome(lambda: dist.irecv(b, peer, group=g).wait())}


def case_peer_exit(rank: int, ctx: Ctx) -> dict[str, Any]:
    """Terminal: the odd ranks exit while their peers wait on them."""
    g, peer = fresh(), peer_of(rank)
    if rank % 2:
        ctx["save"]()
        time.sleep(0.5)
        os._exit(0)
    w = dist.irecv(torch.zeros(2), peer, group=g)
    return outcome(w.wait)


# ---------------------------------------------------------------------- results


def case_collectives(rank: int, ctx: Ctx) -> dict[str, Any]:
    """Each collective on the twin's default group and on gloo, same inputs."""
    gloo = ctx["gloo"]
    out: dict[str, Any] = {}

    def both(name: str, fn: Callable[[Any], Any]) -> None:
        out[name] = (fn(None), fn(gloo))

    def reduced(dtype: torch.dtype, op: Any) -> Callable[[Any], torch.Tensor]:
        def run(group: Any) -> torch.Tensor:
            t = inputs(rank, dtype)
            dist.all_reduce(t, op=op, group=group)
            return t
        return run

    for dtype in (torch.float32, torch.int64):
        for name in ("SUM", "MAX", "MIN", "PRODUCT"):
            both(f"all_reduce {name} {dtype}", reduced(dtype, getattr(dist.ReduceOp, name)))
    out["all_reduce AVG torch.float32"] = (reduced(torch.float32, dist.ReduceOp.AVG)(None), None)
    pair_twin = dist.new_group([0, 1])
    pair_gloo = dist.new_group([0, 1], backend="gloo")
    if rank < 2:
        out["two-rank SUM"] = (reduced(torch.float32, dist.ReduceOp.SUM)(pair_twin),
                               reduced(torch.float32, dist.ReduceOp.SUM)(pair_gloo))
    x = inputs(rank, torch.float32, 6)

    def bcast(group: Any) -> torch.Tensor:
        t = x.clone()
        dist.broadcast(t, 2, group=group)
        return t

    def gather_list(group: Any) -> list[torch.Tensor]:
        outs = [torch.zeros(6) for _ in range(WORLD)]
        dist.all_gather(outs, x, group=group)
        return outs

    def gather_tensor(group: Any) -> torch.Tensor:
        o = torch.zeros(WORLD * 6)
        dist.all_gather_into_tensor(o, x, group=group)
        return o

    def reduce_scatter(group: Any) -> torch.Tensor:
        o = torch.zeros(4, dtype=torch.int64)
        dist.reduce_scatter_tensor(o, inputs(rank, torch.int64, 4 * WORLD), group=group)
        return o

    def to_all(group: Any) -> torch.Tensor:
        o = torch.zeros(2 * WORLD)
        dist.all_to_all_single(o, torch.arange(2.0 * WORLD) + 100 * rank, group=group)
        return o

    def gather(group: Any) -> list[torch.Tensor]:
        outs = [torch.zeros(6) for _ in range(WORLD)] if rank == 1 else None
        dist.gather(x, outs, dst=1, group=group)
        return outs or []

    def scatter(group: Any) -> torch.Tensor:
        o = torch.zeros(3)
        pieces = [torch.arange(3.0) + 10 * j for j in range(WORLD)] if rank == 3 else None
        dist.scatter(o, pieces, src=3, group=group)
        return o

    def reduce(group: Any) -> torch.Tensor:
        t = inputs(rank, torch.int64, 5)
        dist.reduce(t, dst=0, group=group)
        return t

    def objects(group: Any) -> tuple[list[Any], list[Any]]:
        got: list[Any] = [None] * WORLD
        dist.all_gather_object(got, {"rank": rank, "text": "x" * rank}, group=group)
        sent = [{"from": 2}, [1, 2, 3]] if rank == 2 else [None, None]
        dist.broadcast_object_list(sent, src=2, group=group)
        dist.barrier(group=group)
        return got, sent

    for name, fn in (("broadcast", bcast), ("all_gather", gather_list),
                     ("all_gather_into_tensor", gather_tensor), ("reduce_scatter_tensor", reduce_scatter),
                     ("all_to_all_single", to_all), ("gather", gather), ("scatter", scatter),
                     ("reduce", reduce), ("objects", objects)):
        both(name, fn)
    return out


def case_dtensor(rank: int, ctx: Ctx) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    full = torch.randn(8, 6)
    d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    gathered = d.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    partial = DTensor.from_local(torch.full((4, 3), float(rank + 1)), mesh, [Partial(), Replicate()])
    return {
        "groups": [type(mesh.get_group(i)).__name__ for i in range(2)],
        "gathered_equal": torch.equal(gathered, full),
        "reduced": partial.redistribute(mesh, [Replicate(), Replicate()]).to_local(),
        "scattered": partial.redistribute(mesh, [Shard(0), Replicate()]).to_local(),
    }


# ---------------------------------------------------------------------- spawning


def _worker(rank: int, outdir: str, port: int, cases: list[str]) -> None:
    os.environ["ENGINE_NCCL_TWIN_DEADLOCK_S"] = str(DEADLOCK_S)
    torch.set_num_threads(1)
    import engine.testing.nccl_twin  # noqa: F401  (registers the backend)

    path = os.path.join(outdir, f"rank{rank}.pt")
    results: dict[str, Any] = {}
    try:
        dist.init_process_group("nccl_twin", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
        evens = dist.new_group([0, 2], backend="gloo", timeout=datetime.timedelta(seconds=60))
        ctx: Ctx = {"gloo": gloo, "save": lambda: torch.save(results, path)}
        for name in cases:
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            try:
                results[name] = globals()[f"case_{name}"](rank, ctx)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            results[name + ".seconds"] = time.perf_counter() - t0
            torch.save(results, path)
        if rank % 2 == 0:
            dist.barrier(group=evens)  # rank 0 holds the store: leave after rank 2 is done
    except Exception:
        results["fatal"] = traceback.format_exc()
    torch.save(results, path)
    os._exit(0)


def spawn(cases: list[str], timeout: float = 150.0) -> list[dict[str, Any]]:
    """Run ``cases`` (names of ``case_*`` here) on 4 twin ranks; each rank's results."""
    return run_ranks(WORLD, _worker, (free_port(), cases), timeout, prefix="engine-twin-")
