"""What each rank runs in the unflushed save / resume tests under gloo
(tests/checkpoint/test_resume_inflight_ranks.py); spawned by distributed_support.spawn as phases
``resume_support.<name>``.

Why a module apart from distributed_support: these phases compare a run saved unflushed at
several steps against the same run never interrupted, across S (2, 3, 4, 8 ranks) and data
parallelism, and once across two process groups (the save's processes exit, new ones load).
The 4-rank divergence of issue 21 hid behind tests that ran S = 2 only: the gradient
receives a rank posts ahead must be posted in message order, and a resumed rank had not
seen the activations in flight travel, so it skipped their receives and gloo matched the
next gradient into them.
"""

from __future__ import annotations

from distributed_support import transport_under_test

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
from distributed_support import batch, configs, nan_batch, replica_rows, stage_factories
from torch import nn

#: every asynchronous schedule and mitigation of distributed_support.configs
ASYNC = [
    "pipedream", "pipedream-k2-nockpt", "2bw", "pb", "pb-1f1b", "pb-k2", "pb-sc", "pb-lwp",
    "pb-lwp-momentum", "pb-spectrain", "pb-spectrain-reuse", "pb-pipemare-t2", "pb-pipemare-t1",
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()))


def _tensors(pipe: Any) -> list[torch.Tensor]:
    """This rank's weights, optimizer state and update counts (bitwise comparable)."""
    out = []
    for st in pipe.stages:
        out += [t.detach().clone() for t in st.module.state_dict().values()]
        for s in st.optimizer.state.values():
            out += [v.clone() for v in s.values() if isinstance(v, torch.Tensor)]
        out.append(torch.tensor(st.updates))
    return out


def _make(S: int, kw: dict[str, Any], R: int) -> Any:
    from engine import Pipeline

    kw = {"checkpoint": "except_last", **kw}  # live weights save unflushed only when recomputed
    return Pipeline(
        stage_factories(S), loss_fn=nn.functional.mse_loss, transport=transport_under_test(), timeout=30,
        data_parallel=R, **kw,
    )


def _data(pipe: Any, R: int, nan: bool) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Step t's batch for this rank's replica (R replicas share a batch R times larger)."""
    B, M = 8, pipe.spec.chunks
    make = nan_batch if nan else batch
    if R == 1:
        return lambda t: make(t, B)
    shard = replica_rows(pipe.layout.replica, R, B // M)
    return lambda t: tuple(shard(x) for x in make(t, R * B))  # type: ignore[return-value]


def _anyone(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (all ranks call it)."""
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def resume_points(
    rank: int, S: int, names: list[str], points: list[int], steps: int, R: int = 1,
    chunks: int | None = None,
) -> dict[str, Any]:
    """Per configuration: one run never interrupted, one that saves its unflushed state
    (pipe.state_dict()) after each step in ``points`` and goes on, and per point a fresh
    pipeline that loads that state and runs to ``steps``: its losses and final state must
    equal the uninterrupted run's bit for bit. A NotFlushedError at a save is recorded (a
    configuration that cannot rebuild its forwards says so; the test decides if it may)."""
    from engine.errors import NotFlushedError

    out: dict[str, Any] = {}
    for name in names:
        nan = name.startswith("nan-")
        kw = dict(configs(S)[name.removeprefix("nan-")])
        if nan:
            kw["on_nonfinite"] = "skip_update"
        if chunks is not None:
            kw["chunks"] = chunks
        res: dict[str, Any] = {}
        try:
            ref = _make(S, kw, R)
            data = _data(ref, R, nan)
            ref_losses = [ref.step(*data(t)).clone() for t in range(steps)]
            ref.flush()
            want = _tensors(ref)
            a = _make(S, kw, R)
            states: dict[int, Any] = {}
            for t in range(steps):
                a.step(*data(t))
                if t + 1 in points:
                    why = ""
                    try:
                        state = a.state_dict()
                    except NotFlushedError as exc:
                        why = str(exc)
                    if _anyone(bool(why)):  # (engine.save agrees the same way)
                        res[t + 1] = {"refused": why or "by another rank"}
                    else:
                        states[t + 1] = state
            a.flush()
            res["saving_run_equal"] = all(_same(x, y) for x, y in zip(_tensors(a), want, strict=True))
            for k, state in states.items():
                b = _make(S, kw, R)
                b.load_state_dict(state)
                losses = [b.step(*data(t)).clone() for t in range(k, steps)]
                b.flush()
                got = _tensors(b)
                res[k] = {
                    "in_flight": "in_flight" in state,
                    "losses_equal": all(_same(x, y) for x, y in zip(losses, ref_losses[k:], strict=True)),
                    "state_equal": len(got) == len(want)
                    and all(_same(x, y) for x, y in zip(got, want, strict=True)),
                }
        except Exception:
            res["error"] = traceback.format_exc()
        out[name] = res
    return out


# ------------------------------------------- across process groups (issue 21's exact repro)

WIDTH = 16


def mlp_factories(S: int) -> list[Callable[[], nn.Module]]:
    """nn.Linear(16, 16) + tanh per stage, seeded by stage index."""

    def make(s: int) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            torch.manual_seed(2000 + s)
            return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())

        return build

    return [make(s) for s in range(S)]


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(30_000 + step)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


def _mlp(S: int, schedule: str) -> Any:
    import engine.optim as eo
    from engine import Pipeline

    return Pipeline(
        mlp_factories(S), schedule=schedule, chunks=4, loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: eo.SGD(p, lr=0.1, momentum=0.9), transport=transport_under_test(), timeout=30,
        checkpoint="except_last",  # live weights save unflushed only when recomputed
    )


def save_and_exit(rank: int, S: int, root: str, schedules: list[str], k: int) -> dict[str, Any]:
    """The first job: k steps, then engine.save without a flush; the processes then exit."""
    import engine

    out: dict[str, Any] = {}
    for schedule in schedules:
        try:
            pipe = _mlp(S, schedule)
            for t in range(k):
                pipe.step(*mlp_batch(t))
            engine.save(pipe, os.path.join(root, schedule))
            out[schedule] = {"flushed": pipe.flushed}
        except Exception:
            out[schedule] = {"error": traceback.format_exc()}
    return out


def load_and_finish(
    rank: int, S: int, root: str, schedules: list[str], k: int, steps: int
) -> dict[str, Any]:
    """The second job (a new process group): the uninterrupted run, then a fresh pipeline
    that loads the first job's checkpoint, continues from pipe.steps and flushes."""
    import engine

    out: dict[str, Any] = {}
    for schedule in schedules:
        try:
            ref = _mlp(S, schedule)
            for t in range(steps):
                ref.step(*mlp_batch(t))
            ref.flush()
            pipe = _mlp(S, schedule)
            engine.load(pipe, os.path.join(root, schedule))
            start = pipe.steps
            for t in range(start, steps):
                pipe.step(*mlp_batch(t))
            pipe.flush()
            a, b = _tensors(ref), _tensors(pipe)
            out[schedule] = {
                "start": start,
                "equal": all(torch.equal(x, y) for x, y in zip(a, b, strict=True)),
                "max_diff": max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True)),
            }
        except Exception:
            out[schedule] = {"error": traceback.format_exc()}
    return out
