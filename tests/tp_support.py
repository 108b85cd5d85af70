"""Tensor parallelism inside a stage (issue 27): the small transformer and what each rank runs.

The model: stage 0 = input projection + one transformer block, stage 1 = one block + output
projection. A block is pre-norm attention (q, k, v column-wise, o row-wise) and a pre-norm MLP
(fc1 column-wise, fc2 row-wise), Megatron's split: each tp rank holds heads/tp heads and
hidden/tp MLP units, and the block's output is replicated (a plain tensor) on every tp rank.
Factories are seeded by stage, so the sharded, the unsharded and the reference runs start
from the same weights.
"""

from __future__ import annotations

from distributed_support import transport_under_test

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.runtime.tensor_parallel import input_placements, stage_tp

D, HEADS, HIDDEN, T, OUT = 8, 4, 16, 3, 4
STEPS = 6


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no key bias: its gradient is zero in exact arithmetic (softmax ignores a constant
        # per query), so Adam would normalise rounding noise and no tolerance would hold
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D, bias=False), nn.Linear(D, D)
        self.o = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        hd = D // HEADS  # under tensor parallelism q/k/v hold heads/tp heads: -1 below

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, L, -1, hd).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / hd**0.5, dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(B, L, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention()
        self.fc1, self.fc2 = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class Stage(nn.Module):
    def __init__(self, s: int, S: int) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D) if s == 0 else nn.Identity()
        self.block = Block()
        self.out = nn.Linear(D, OUT) if s == S - 1 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


PLAN_NAMES = {
    "block.attn.q": "col", "block.attn.k": "col", "block.attn.v": "col", "block.attn.o": "row",
    "block.fc1": "col", "block.fc2": "row",
}


def factories(S: int) -> list[Callable[..., nn.Module]]:
    """Per-stage factories: with a tp_mesh of size > 1 the block is sharded by torch's
    parallelize_module (column-wise in, row-wise out)."""

    def make(s: int) -> Callable[..., nn.Module]:
        def build(tp_mesh: Any = None) -> nn.Module:
            torch.manual_seed(300 + s)
            m = Stage(s, S)
            if tp_mesh is not None and tp_mesh.size() > 1:
                from torch.distributed.tensor.parallel import (
                    ColwiseParallel,
                    RowwiseParallel,
                    parallelize_module,
                )

                plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel()
                        for k, v in PLAN_NAMES.items()}
                parallelize_module(m, tp_mesh, plan)
            return m

        return build

    return [make(s) for s in range(S)]


def split_factories(S: int = 2) -> list[Callable[..., nn.Module]]:
    """A column-parallel layer at the end of stage 0 and its row-parallel partner at the start
    of stage 1: the activation between them is a DTensor sharded on its last dimension, and
    each tp rank sends only its half to the next stage."""

    def make(s: int) -> Callable[..., nn.Module]:
        def build(tp_mesh: Any = None) -> nn.Module:
            torch.manual_seed(700 + s)
            if s == 0:
                m = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, HIDDEN), nn.GELU())
            else:
                m = nn.Sequential(nn.Linear(HIDDEN, D), nn.Tanh(), nn.Linear(D, OUT))
            if tp_mesh is not None and tp_mesh.size() > 1:
                from torch.distributed.tensor.parallel import (
                    ColwiseParallel,
                    RowwiseParallel,
                    parallelize_module,
                )

                style = ColwiseParallel(use_local_output=False) if s == 0 else RowwiseParallel()
                parallelize_module(m, tp_mesh, {"2" if s == 0 else "0": style})
            return m

        return build

    return [make(s) for s in range(S)]


def batch(step: int, B: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(B, T, D, generator=g), torch.randn(B, T, OUT, generator=g)


def sgd(**kw: Any) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    import engine.optim as eo

    return lambda p: eo.SGD(p, lr=0.05, momentum=0.9, **kw)


def configs() -> dict[str, dict[str, Any]]:
    import engine.optim as eo

    return {
        "gpipe": dict(schedule="gpipe", optimizer=sgd()),
        "1f1b-adam": dict(schedule="1f1b", optimizer=lambda p: eo.Adam(p, lr=1e-2)),
        "1f1b": dict(schedule="1f1b", optimizer=sgd()),
        "gpipe-clip": dict(schedule="gpipe", optimizer=sgd(), clip_grad_norm=0.05),
        "pb-lwp": dict(schedule="pb", optimizer=sgd(prediction="linear"), checkpoint="never"),
        "pipedream": dict(schedule="pipedream", optimizer=sgd()),
        "pb-clip": dict(schedule="pb", optimizer=sgd(), clip_grad_norm=0.05),
        "split-1f1b": dict(schedule="1f1b", optimizer=sgd()),
        "split-pb-lwp": dict(schedule="pb", optimizer=sgd(prediction="linear"), checkpoint="never"),
    }


#: the synchronous configurations (compared with the unpipelined, unsharded model)
SYNC = ("gpipe", "1f1b", "1f1b-adam", "gpipe-clip", "split-1f1b")


def model(name: str) -> Callable[[int], list[Callable[..., nn.Module]]]:
    return split_factories if name.startswith("split-") else factories


def reference(name: str, S: int, steps: int, B: int, M: int) -> list[torch.Tensor]:
    """The unpipelined, unsharded model trained with torch's optimizer on whole batches
    (equal micro-batches: the mean of their mean losses is the batch's mean loss)."""
    net = nn.Sequential(*[f() for f in model(name)(S)])
    params = list(net.parameters())
    if name.endswith("-adam"):
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=1e-2)
    else:
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    for t in range(steps):
        x, y = batch(t, B)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        if name == "gpipe-clip":
            torch.nn.utils.clip_grad_norm_(params, 0.05)
        opt.step()
    return [p.detach() for p in params]


def shard_of(full: torch.Tensor, placements: Any, rank: int, size: int) -> torch.Tensor:
    from torch.distributed.tensor import Shard

    for p in placements:
        if isinstance(p, Shard):
            return full.chunk(size, p.dim)[rank]
    return full


def my_shards(
    pipe: Any, full_by_stage: dict[int, list[torch.Tensor]], S: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(this rank's trained parameter, the same shard of the reference) per parameter."""
    lay = pipe.layout
    out = []
    for st in pipe.stages:
        module = st.module
        tp = stage_tp(module)
        placement = {id(e[2]): e[4] for e in tp.entries} if tp is not None else {}
        full = full_by_stage[st.index]
        for p, f in zip(module.parameters(), full, strict=True):
            where = (getattr(lay, "tp_rank", 0), getattr(lay, "tp", 1))
            ref = shard_of(f, placement.get(id(p), ()), *where)
            out.append((p.detach(), ref))
    return out


def split_reference(params: list[torch.Tensor], S: int, name: str) -> dict[int, list[torch.Tensor]]:
    counts = [sum(1 for _ in f().parameters()) for f in model(name)(S)]
    out, k = {}, 0
    for s, n in enumerate(counts):
        out[s] = params[k : k + n]
        k += n
    return out


def phase_tp_train(
    rank: int, shape: tuple[int, ...], names: list[str], B: int = 8, M: int = 2
) -> dict[str, Any]:
    """Each configuration on the mesh ``shape`` = (pp, dp, tp): synchronous ones against the
    unpipelined unsharded model, asynchronous ones against the same schedule without TP (the
    local pipeline of the unsharded stages)."""
    from torch.distributed.device_mesh import init_device_mesh

    from engine import Pipeline
    from distributed_support import replica_rows

    pp, dp, tp = shape
    S = pp
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
    out: dict[str, Any] = {}
    for name in names:
        kw = dict(configs()[name], chunks=M)
        try:
            make = model(name)
            pipe = Pipeline(make(S), loss_fn=nn.functional.mse_loss, transport=transport_under_test(),
                            mesh=mesh, timeout=60, **kw)
            shard = replica_rows(pipe.layout.replica, dp, B // M) if dp > 1 else None
            losses = []
            for t in range(STEPS):
                x, y = batch(t, B * dp)
                if shard is not None:
                    x, y = shard(x), shard(y)
                losses.append(float(pipe.step(x, y)))
            pipe.flush()
            evaluated = None
            if name in SYNC:
                whole = reference(name, S, STEPS, B * dp, M)
                ref = split_reference(whole, S, name)
                net = nn.Sequential(*[f() for f in make(S)])
                with torch.no_grad():
                    for p, w in zip(net.parameters(), whole, strict=True):
                        p.copy_(w)
                    x = batch(99, B)[0]
                    evaluated = float((pipe.evaluate(x) - net.eval()(x)).abs().max())
            else:
                local = Pipeline([f() for f in make(S)], loss_fn=nn.functional.mse_loss, **kw)
                for t in range(STEPS):
                    local.step(*batch(t, B * dp))
                local.flush()
                ref = {st.index: [p.detach() for p in st.module.parameters()]
                       for st in local.stages}
            pairs = my_shards(pipe, ref, S)
            fresh = {s: [p.detach() for p in f().parameters()] for s, f in enumerate(make(S))}
            init = my_shards(pipe, fresh, S)
            diffs = [float((a - b).abs().max()) for a, b in pairs]
            pnames = [n for st in pipe.stages for n, _ in st.module.named_parameters()]
            out[name] = {
                "max_diff": max(diffs),
                "worst": pnames[diffs.index(max(diffs))],
                "moved": max(float((a - b).abs().max())
                             for (a, _), (_, b) in zip(pairs, init, strict=True)),
                "shapes": [tuple(a.shape) for a, _ in pairs],
                "losses": losses,
                "tp": pipe.tensor_parallel,
                "evaluate_diff": evaluated,
                "inputs": repr(input_placements(pipe.stages[0].module) and
                               input_placements(pipe.stages[0].module).placements),
            }
        except Exception as exc:
            import traceback

            out[name] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
    return out


def phase_tp_refusals(rank: int) -> dict[str, Any]:
    """Muon on sharded matrices, and a mesh whose pp size is not the stage count."""
    from torch.distributed.device_mesh import init_device_mesh

    import engine.optim as eo
    from engine import Pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    odd = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    out: dict[str, Any] = {}
    for name, stages, opt, extra in (
        ("muon", factories(2), lambda p: eo.Muon(p, lr=0.02), {}),
        ("pp_size", factories(4), sgd(), {}),
        ("dim_name", factories(2), sgd(), dict(mesh=odd)),
        ("data_parallel", factories(2), sgd(), dict(data_parallel=2)),
        ("local", factories(2), sgd(), dict(transport="local")),
        ("not_a_mesh", factories(2), sgd(), dict(mesh=[[0, 1], [2, 3]])),
        ("float16", factories(2), sgd(), dict(autocast=torch.float16)),
    ):
        try:
            kw: dict[str, Any] = {**dict(transport=transport_under_test(), mesh=mesh, timeout=30), **extra}
            Pipeline(stages, schedule="gpipe", chunks=2, loss_fn=nn.functional.mse_loss,
                     optimizer=opt, **kw)
            out[name] = "built"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    try:  # the last stage ends column-parallel with a DTensor output: loss_fn cannot take it
        pipe = Pipeline([split_factories(2)[0], _sharded_last],
                        schedule="gpipe", chunks=2, loss_fn=nn.functional.mse_loss,
                        optimizer=sgd(), transport=transport_under_test(), mesh=mesh, timeout=30)
        pipe.step(*batch(0))
        out["sharded_last"] = "ran"
    except Exception as exc:
        out["sharded_last"] = f"{type(exc).__name__}: {exc}"
    return out


def _sharded_last(tp_mesh: Any = None) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(9)
    m = nn.Sequential(nn.Linear(HIDDEN, OUT))
    parallelize_module(m, tp_mesh, {"0": ColwiseParallel(use_local_output=False)})
    return m


def phase_tp_checkpoint(rank: int, root: str) -> dict[str, Any]:
    """Save a TP=2 x PP=2 pipeline after 2 steps, run 2 more; a fresh pipeline loads and runs
    the same 2 steps: equal bit for bit. A TP=1 x DP=2 pipeline refuses the checkpoint."""
    from torch.distributed.device_mesh import init_device_mesh

    import engine
    from engine import Pipeline

    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    path = os.path.join(root, "tp-ckpt")

    def make(m: Any = mesh) -> Any:
        import engine.optim as eo

        return Pipeline(factories(2), schedule="1f1b", chunks=2, loss_fn=nn.functional.mse_loss,
                        optimizer=lambda p: eo.Adam(p, lr=1e-2), transport=transport_under_test(), mesh=m,
                        timeout=60)

    try:
        a = make()
        for t in range(2):
            a.step(*batch(t))
        engine.save(a, path)
        la = [float(a.step(*batch(t))) for t in (2, 3)]
        b = make()
        engine.load(b, path)
        lb = [float(b.step(*batch(t))) for t in (2, 3)]
        wa = [p.detach() for p in a.stages[0].module.parameters()]
        wb = [p.detach() for p in b.stages[0].module.parameters()]
        out["equal"] = la == lb and all(torch.equal(x, y) for x, y in zip(wa, wb, strict=True))
        out["shapes"] = [tuple(p.shape) for p in wa]
        import json

        with open(os.path.join(path, "manifest.json")) as f:
            out["manifest"] = json.load(f)
    except Exception:
        import traceback

        out["error"] = traceback.format_exc()
    try:  # unflushed: pipedream's micro-batches in flight (local parts on the wire) are saved
        def make_async() -> Any:
            return Pipeline(factories(2), schedule="pipedream", chunks=2,
                            loss_fn=nn.functional.mse_loss, optimizer=sgd(), transport=transport_under_test(),
                            mesh=mesh, timeout=60)

        a = make_async()
        for t in range(3):
            a.step(*batch(t))
        engine.save(a, path + "-inflight")
        la = [float(a.step(*batch(t))) for t in (3, 4)]
        a.flush()
        b = make_async()
        engine.load(b, path + "-inflight")
        lb = [float(b.step(*batch(t))) for t in (3, 4)]
        b.flush()
        wa = [p.detach() for p in a.stages[0].module.parameters()]
        wb = [p.detach() for p in b.stages[0].module.parameters()]
        same = all(torch.equal(x, y) for x, y in zip(wa, wb, strict=True))
        out["inflight_equal"] = la == lb and same
    except Exception:
        import traceback

        out["inflight_error"] = traceback.format_exc()
    try:
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        c = make(other)
        engine.load(c, path)
        out["other_tp"] = "loaded"
    except Exception as exc:
        out["other_tp"] = f"{type(exc).__name__}: {exc}"
    return out
