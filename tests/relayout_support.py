"""Checkpoints that move between layouts: the model, the runs, and what each gloo rank does.

The model is one ``nn.Sequential`` of 8 layers cut by ``balance`` (its stages keep the model's
layer names, so a checkpoint of any cut loads into any other). Runs: ``k`` steps, save, then
``n - k`` more; a pipeline of another layout loads the checkpoint and runs the same ``n - k``
steps; the exported model (``engine.export``) is compared with the first run's.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import engine
import engine.optim as eo

DIM, OUT, LAYERS = 6, 3, 8
B, M = 8, 2  # rows per step, micro-batches per step
K, N = 2, 4  # save after K steps, compare after N


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS // 2):
        layers += [nn.Linear(DIM, DIM if i < LAYERS // 2 - 1 else OUT), nn.Tanh()]
    return nn.Sequential(*layers)


def balance(S: int) -> list[int]:
    q, r = divmod(LAYERS, S)
    return [q + (1 if s < r else 0) for s in range(S)]


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda p: eo.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: eo.AdamW(p, lr=0.01, weight_decay=0.1),
}


def batch(t: int, rows: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(40_000 + t)
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, OUT, generator=g)


def pipe(S: int, schedule: str, opt: str, **kw: Any) -> engine.Pipeline:
    return engine.Pipeline(model(), balance=balance(S), schedule=schedule, chunks=M,
                           loss_fn=nn.functional.mse_loss, optimizer=OPTIMIZERS[opt], **kw)


def run(p: Any, steps: range, shard: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[float]:
    out = []
    for t in steps:
        x, y = batch(t)
        if shard is not None:
            x, y = shard(x), shard(y)
        out.append(float(p.step(x, y)))
    p.flush()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _reads(into: list[tuple[str, str]]) -> Callable[[], None]:
    """Record every (file, tensor) a StateFile reads; returns the undo."""
    from engine.serialization import StateFile

    real = StateFile.tensor

    def tensor(self: StateFile, name: str) -> torch.Tensor:
        into.append((os.path.basename(self.path), name))
        return real(self, name)

    StateFile.tensor = tensor  # type: ignore[method-assign]

    def undo() -> None:
        StateFile.tensor = real  # type: ignore[method-assign]

    return undo


def phase_relayout(rank: int, root: str) -> dict[str, Any]:
    """Per (optimizer, schedule): a world-stage gloo pipeline saves after K steps and runs to
    N. Every rank then loads the directory into local pipelines of S/2 and 1 stages (bit for
    bit against the local world-stage run), and all ranks into a gloo pipeline of S/2 stages x
    2 replicas (within 1e-6), each rank reading only the files of the stages it holds. Rank
    0's ``engine.export`` of the gloo run is the whole model."""
    import torch.distributed as dist

    from distributed_support import replica_rows
    from engine.checkpoint_dir import read_manifest

    world = dist.get_world_size()
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        for schedule in ("gpipe", "1f1b"):
            name = f"{opt}-{schedule}"
            got: dict[str, Any] = {}
            try:
                path = os.path.join(root, name)
                a = pipe(world, schedule, opt, transport="gloo", timeout=60)
                run(a, range(K))
                engine.save(a, path)
                run(a, range(K, N))
                exported = engine.export(a)
                local = pipe(world, schedule, opt)
                run(local, range(N))
                ref = engine.export(local)
                got["export_rank0_whole"] = same(exported, ref) if rank == 0 else exported == {}
                for S in sorted({max(world // 2, 1), 1}):
                    b = pipe(S, schedule, opt)
                    engine.load(b, path)
                    run(b, range(K, N))
                    got[f"local_S{S}"] = same(engine.export(b), ref)
                S2 = max(world // 2, 1)
                c = pipe(S2, schedule, opt, transport="gloo", data_parallel=world // S2, timeout=60)
                reads: list[tuple[str, str]] = []
                undo = _reads(reads)
                try:
                    engine.load(c, path)
                finally:
                    undo()
                man = read_manifest(path)
                got["index_sums"] = all(len(e.get("index_sha256", "")) == 64 for e in man["ranks"])
                mine = set(range(c.layout.stage * (world // S2), (c.layout.stage + 1) * (world // S2)))
                allowed = {e["file"] for e in man["ranks"] if e["stage"] in mine}
                got["reads_own_files"] = bool(reads) and {f for f, _ in reads} <= allowed
                got["read_fraction"] = len({n for _, n in reads}) / max(1, _count(path))
                R = world // S2
                run(c, range(K, N), replica_rows(c.layout.replica, R, B // M // R))
                moved = engine.export(c)
                got["dp_diff"] = diff(moved, ref) if rank == 0 else 0.0
            except Exception:
                got["error"] = traceback.format_exc()
            out[name] = got
    out["refusal"] = _unflushed_refusal(rank, root, world)
    return out


def _count(path: str) -> int:
    from engine.checkpoint_dir import read_manifest
    from engine.serialization import StateFile

    return sum(len(StateFile(os.path.join(path, e["file"])).info) for e in read_manifest(path)["ranks"])


def _unflushed_refusal(rank: int, root: str, world: int) -> dict[str, Any]:
    """pipedream saved unflushed at world stages, loaded at world/2 x 2 replicas: refused on
    every rank, naming both layouts and the fix, nothing changed."""
    from distributed_support import _params

    path = os.path.join(root, "unflushed")
    try:
        a = pipe(world, "pipedream", "sgd", transport="gloo", timeout=60)
        for t in range(3):
            a.step(*batch(t))
        engine.save(a, path)
        S2 = max(world // 2, 1)
        c = pipe(S2, "pipedream", "sgd", transport="gloo", data_parallel=world // S2, timeout=60)
        before = _params(c)
        try:
            engine.load(c, path)
            return {"message": "LOADED"}
        except engine.CheckpointError as exc:
            after = _params(c)
            unchanged = all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
            return {"message": str(exc), "unchanged": unchanged}
    except Exception:
        return {"error": traceback.format_exc()}


# ------------------------------------------------------------------ tensor parallelism


def tp_layer(i: int) -> nn.Module:
    """Layer i of the 4-layer model: input projection, two transformer blocks, output."""
    import tp_support as T

    torch.manual_seed(900 + i)
    if i == 0:
        return nn.Linear(T.D, T.D)
    if i == 3:
        return nn.Linear(T.D, T.OUT)
    return T.Block()


def tp_stage(lo: int, hi: int) -> Any:
    """The factory of the stage holding layers lo..hi-1 under their model names ("1.attn.q"),
    its blocks sharded Megatron's way on a tp mesh of size > 1."""
    import tp_support as T

    def build(tp_mesh: Any = None) -> nn.Module:
        from collections import OrderedDict

        m = nn.Sequential(OrderedDict((str(i), tp_layer(i)) for i in range(lo, hi)))
        if tp_mesh is not None and tp_mesh.size() > 1:
            from torch.distributed.tensor.parallel import (
                ColwiseParallel, RowwiseParallel, parallelize_module,
            )

            plan = {f"{i}.{k.removeprefix('block.')}": ColwiseParallel() if v == "col" else RowwiseParallel()
                    for i in range(lo, hi) if i in (1, 2) for k, v in T.PLAN_NAMES.items()}
            parallelize_module(m, tp_mesh, plan)
        return m

    return engine.named_stage(build, "")


def tp_pipe(shape: tuple[int, int, int]) -> engine.Pipeline:
    from torch.distributed.device_mesh import init_device_mesh

    pp = shape[0]
    cuts = {1: [(0, 4)], 2: [(0, 2), (2, 4)]}[pp]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
    return engine.Pipeline([tp_stage(lo, hi) for lo, hi in cuts], schedule="1f1b", chunks=M,
                           loss_fn=nn.functional.mse_loss, optimizer=lambda p: eo.Adam(p, lr=1e-2),
                           transport="gloo", mesh=mesh, timeout=120)


def _tp_run(p: Any, steps: range, rows: int = 16) -> None:
    import tp_support as T

    from distributed_support import replica_rows

    R = p.replicas
    shard = replica_rows(p.layout.replica, R, rows // M // R)
    for t in steps:
        x, y = T.batch(t, rows)
        p.step(shard(x), shard(y))
    p.flush()


def phase_relayout_tp(rank: int, root: str) -> dict[str, Any]:
    """TP=2 x PP=2 x DP=2 saves after K steps and runs to N; TP=1 x PP=2 (x DP=4) and
    TP=2 x PP=1 (x DP=4) load it and run the same steps: rank 0's export within 1e-6 of the
    first run's. A TP=2 x PP=2 x DP=2 pipeline started from the exported model file holds it
    exactly. Tensor-parallel rank 0 of the TP=2 x PP=1 run reads no file of tp rank 1."""
    import torch.distributed as dist

    from engine.checkpoint_dir import read_manifest
    from engine.serialization import write_plain

    out: dict[str, Any] = {}
    path = os.path.join(root, "tp")
    try:
        a = tp_pipe((2, 2, 2))
        _tp_run(a, range(K))
        engine.save(a, path)
        _tp_run(a, range(K, N))
        ref = engine.export(a)
        out["export_keys"] = sorted(ref)
        man = read_manifest(path)
        for label, shape in (("tp1_pp2", (2, 4, 1)), ("tp2_pp1", (1, 4, 2))):
            b = tp_pipe(shape)
            reads: list[tuple[str, str]] = []
            undo = _reads(reads)
            try:
                engine.load(b, path)
            finally:
                undo()
            tp_of = {e["file"]: e.get("tp_rank", 0) for e in man["ranks"]}
            stage_of = {e["file"]: e["stage"] for e in man["ranks"]}
            files = {f for f, _ in reads}
            if label == "tp2_pp1" and b.layout.tp_rank == 0:
                out[f"{label}_reads_own_shards"] = bool(files) and all(tp_of[f] == 0 for f in files)
            if label == "tp1_pp2":
                out[f"{label}_reads_own_stage"] = bool(files) and all(
                    stage_of[f] == b.layout.stage for f in files)
            _tp_run(b, range(K, N))
            got = engine.export(b)
            out[label] = diff(got, ref) if rank == 0 else 0.0
        file = os.path.join(root, "model.safetensors")
        if rank == 0:
            write_plain(ref, file)
        dist.barrier()
        c = tp_pipe((2, 2, 2))
        engine.load(c, file)
        got = engine.export(c)
        out["from_file"] = same(got, ref) if rank == 0 else got == {}
    except Exception:
        out["error"] = traceback.format_exc()
    return out
