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
