"""What each rank runs for tests/checkpoint/test_checkpoint_dp.py: checkpoints of data-parallel
pipelines, where replica 0 of each (stage, tp rank) writes the weights and optimizer state and
every other replica only its own part (issue 27, item 3).

Stage 0 of the plain model carries a BatchNorm, so each replica's running statistics differ
(they come from its own rows): the own part must keep them. The mesh variant runs the small
transformer of tests/tp_support.py on TP=2 x PP=2 x DP=2.
"""

from __future__ import annotations

from distributed_support import transport_under_test

import os
import secrets
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distributed_support import DIM, OUT, configs, replica_rows

B, M = 4, 2  # rows per replica per step, micro-batches per step


def bn_factories(S: int) -> list[Callable[[], nn.Module]]:
    """distributed_support's model with a BatchNorm in stage 0 (per-replica buffers)."""

    def make(s: int) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            torch.manual_seed(1000 + s)
            if s == 0:
                return nn.Sequential(nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM), nn.Tanh())
            if s == S - 1:
                return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, OUT))
            return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())

        return build

    return [make(s) for s in range(S)]


def _batch(step: int, rows: int, tp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if tp:
        from tp_support import batch

        return batch(step, rows)
    g = torch.Generator().manual_seed(20_000 + step)
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, OUT, generator=g)


def _maker(S: int, R: int, name: str, shape: tuple[int, int, int] | None) -> Callable[[], Any]:
    from engine import Pipeline

    if shape is None:
        kw = dict(configs(S)[name], chunks=M)
        return lambda: Pipeline(bn_factories(S), loss_fn=nn.functional.mse_loss, transport=transport_under_test(),
                                data_parallel=R, timeout=60, **kw)
    from torch.distributed.device_mesh import init_device_mesh

    import tp_support

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
    kw = dict(tp_support.configs()[name], chunks=M)
    return lambda: Pipeline(tp_support.factories(S), loss_fn=nn.functional.mse_loss,
                            transport=transport_under_test(), mesh=mesh, timeout=60, **kw)


def _state(pipe: Any) -> list[torch.Tensor]:
    """Every tensor of this rank's module state (parameters and buffers), local shards."""
    out = []
    for st in pipe.stages:
        for v in st.module.state_dict().values():
            v = v.to_local() if hasattr(v, "to_local") else v
            out.append(v.detach().clone())
    return out


def _tensors(tree: Any) -> int:
    """How many tensors ``tree`` holds."""
    if isinstance(tree, torch.Tensor):
        return 1
    if isinstance(tree, dict):
        return sum(_tensors(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensors(v) for v in tree)
    return 0


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def write_old_format(pipe: Any, path: str) -> None:
    """What engine.save wrote before (checkpoint-dir/1): every rank its whole state."""
    import engine.checkpoint_dir as cd
    from engine.serialization import file_sha256, write_state

    nonce = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    dist.broadcast(nonce, 0)
    rank, S = pipe.layout.rank, pipe.layout.stages
    place = getattr(pipe.layout, "place_of", lambda r: (r % S, r // S, 0))
    name = f"rank{{:05d}}-{int(nonce.item()):016x}.safetensors"
    os.makedirs(path, exist_ok=True)
    write_state(pipe.state_dict(), os.path.join(path, name.format(rank)))
    statuses = cd._exchange(pipe, file_sha256(os.path.join(path, name.format(rank))), "")
    if rank == 0:
        tp = getattr(pipe.layout, "tp", 1) > 1
        ranks = [{"rank": r, "stage": place(r)[0], "replica": place(r)[1], "file": name.format(r),
                  "sha256": h, **({"tp_rank": place(r)[2]} if tp else {})}
                 for r, (h, _) in enumerate(statuses)]
        body = {"format": "engine.checkpoint-dir/1", "layout": cd._layout(pipe),
                "steps": pipe.steps, "ranks": ranks}
        import json

        with open(os.path.join(path, cd.MANIFEST), "w") as f:
            json.dump({**body, "sha256": cd._body_sha256(body)}, f)
    dist.barrier()


def phase_dp_checkpoint(
    rank: int, root: str, R: int, S: int = 2, names: tuple[str, ...] = ("1f1b-adam",),
    unflushed: tuple[str, ...] = ("pipedream",), shape: tuple[int, int, int] | None = None,
    k: int = 3, n: int = 6,
) -> dict[str, Any]:
    """Per configuration: save after step k (flushed, or with micro-batches in flight), run
    to n; a fresh pipeline loads and runs k..n: losses, module state (buffers included) and
    optimizer state equal bit for bit. The flushed ones also write an old-format directory
    that must load the same way. Then the refusals for a corrupted and a missing writer file."""
    import engine
    import engine.checkpoint_dir as cd

    out: dict[str, Any] = {}
    tp = shape is not None
    for name in (*names, *unflushed):
        try:
            make = _maker(S, R, name, shape)
            a = make()
            shard = replica_rows(a.layout.replica, R, B // M)

            def step(p: Any, t: int) -> torch.Tensor:
                x, y = _batch(t, R * B, tp)
                return p.step(shard(x), shard(y)).detach().clone()

            for t in range(k):
                step(a, t)
            if name in names:
                a.flush()
            path = os.path.join(root, name)
            engine.save(a, path)
            if name in names:
                write_old_format(a, path + "-v1")
            st = a.state_dict()  # (a flushed rank may still report an empty in-flight state)
            in_flight = _tensors(st.get("in_flight"))
            saved = _state(a)
            la = [step(a, t) for t in range(k, n)]
            a.flush()
            got: dict[str, Any] = {"in_flight": in_flight, "saved": saved}
            for label, src in (("new", path), ("old", path + "-v1")):
                if label == "old" and name not in names:
                    continue
                b = make()
                engine.load(b, src)
                loaded = _state(b)
                lb = [step(b, t) for t in range(k, n)]
                b.flush()
                got[label] = {
                    "loaded_equal": _same(saved, loaded),
                    "losses_equal": _same(la, lb),
                    "state_equal": _same(_state(a), _state(b)),
                    "optimizer_equal": all(
                        str(x["optimizer"]) == str(y["optimizer"])
                        for x, y in zip(a.state_dict()["stages"], b.state_dict()["stages"], strict=True)
                    ),
                }
            out[name] = got
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    out["refusals"] = _writer_refusals(rank, root, names[0], _maker(S, R, names[0], shape), cd)
    if shape is not None:  # same sizes, another dimension order: the ranks' places differ
        from torch.distributed.device_mesh import init_device_mesh

        import tp_support
        from engine import Pipeline

        other = init_device_mesh("cpu", (shape[1], shape[0], shape[2]), mesh_dim_names=("dp", "pp", "tp"))
        c = Pipeline(tp_support.factories(S), loss_fn=nn.functional.mse_loss, transport=transport_under_test(),
                     mesh=other, timeout=60, **dict(tp_support.configs()[names[0]], chunks=M))
        try:
            engine.load(c, os.path.join(root, names[0]))
            out["other_order"] = "loaded"
        except engine.CheckpointError as exc:
            out["other_order"] = str(exc)
    return out


def _writer_refusals(rank: int, root: str, name: str, make: Callable[[], Any], cd: Any) -> dict[str, Any]:
    """Corrupt, then remove, the file of the rank that writes stage S-1's (tp rank 0's) shared
    state: every rank refuses and keeps its weights; the replica that reads that file says so."""
    from distributed_support import _params, _refused

    path = os.path.join(root, name)
    pipe = make()
    man = cd.read_manifest(path)
    victim = max(e["rank"] for e in man["ranks"] if e["replica"] == 0 and e.get("tp_rank", 0) == 0)
    reader = next(e["rank"] for e in man["ranks"] if e.get("shared_from") == victim and e["rank"] != victim)
    file = os.path.join(path, man["ranks"][victim]["file"])
    data = open(file, "rb").read()
    out: dict[str, Any] = {"victim": victim, "reader": reader, "file": file}

    def edit(change: Callable[[], None]) -> None:
        dist.barrier()
        if rank == 0:
            change()
        dist.barrier()

    def reader_says() -> str:  # this rank's own check, without the collective
        try:
            cd._read_own(pipe, path)
        except engine_error() as exc:
            return str(exc)
        return ""

    edit(lambda: open(file, "wb").write(data[:-1] + bytes([data[-1] ^ 1])))
    out["corrupt"] = _refused(pipe, path)
    out["corrupt_reader"] = reader_says() if rank == reader else ""
    edit(lambda: os.remove(file))
    out["missing"] = _refused(pipe, path)
    out["missing_reader"] = reader_says() if rank == reader else ""
    edit(lambda: open(file, "wb").write(data))
    before = _params(pipe)
    out["restored_loads"] = _refused(pipe, path) == "" and not _same(before, _params(pipe))
    return out


def engine_error() -> type[Exception]:
    from engine import CheckpointError

    return CheckpointError
