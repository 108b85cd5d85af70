"""Spawning gloo process groups for the distributed tests, and what each rank runs.

Why one spawn runs many configurations: starting 4 processes costs ~10 s on 2 cores, a
configuration ~0.1-0.5 s. So each spawn runs a list of *phases*; every rank writes what it
saw to ``outdir/rank{r}.pt`` and the tests read those files. Each rank also runs the local
(single-process) pipeline of the same configuration itself, with the same thread count, so a
bitwise comparison never depends on the other process's BLAS threading.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

DIM, OUT = 6, 3
STEPS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stage_factories(S: int, wrong_input_at: int | None = None) -> list[Callable[[], nn.Module]]:
    """Deterministic per-stage factories (seeded by stage index): the local and the distributed
    runs build identical stages, and a rank builds only its own."""

    def make(s: int) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            torch.manual_seed(1000 + s)
            d_in = DIM + 1 if s == wrong_input_at else DIM
            if s == S - 1:
                return nn.Sequential(nn.Linear(d_in, DIM), nn.Tanh(), nn.Linear(DIM, OUT))
            return nn.Sequential(nn.Linear(d_in, DIM), nn.Tanh())

        return build

    return [make(s) for s in range(S)]


def batch(step: int, B: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(B, DIM, generator=g), torch.randn(B, OUT, generator=g)


def _sgd(**kw: Any) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    import engine.optim as eo

    return lambda p: eo.SGD(p, lr=0.05, momentum=0.9, **kw)


def configs(S: int) -> dict[str, dict[str, Any]]:
    """Every schedule and every mitigation, as Pipeline keyword arguments."""
    import engine.optim as eo

    M = 4
    out: dict[str, dict[str, Any]] = {
        "naive": dict(
            schedule="naive", optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)
        ),
        "gpipe": dict(schedule="gpipe", optimizer=_sgd()),
        "1f1b-adam": dict(schedule="1f1b", optimizer=lambda p: eo.Adam(p, lr=1e-2)),
        "pipedream": dict(schedule="pipedream", optimizer=_sgd()),
        "pipedream-k2-nockpt": dict(
            schedule="pipedream", update_size=2, checkpoint="never", optimizer=_sgd()
        ),
        "2bw": dict(schedule="2bw", optimizer=_sgd()),
        "pb": dict(schedule="pb", optimizer=_sgd()),
        "pb-1f1b": dict(schedule="pb", order="1f1b", optimizer=_sgd()),
        "pb-k2": dict(schedule="pb", update_size=2, optimizer=_sgd()),
        "pb-sc": dict(schedule="pb", optimizer=_sgd(spike_compensation=True)),
        "pb-lwp": dict(schedule="pb", optimizer=_sgd(prediction="linear"), checkpoint="never"),
        "pb-lwp-momentum": dict(schedule="pb", optimizer=_sgd(prediction="momentum")),
        "pb-spectrain": dict(
            schedule="pb", weight_prediction="spectrain", optimizer=_sgd(prediction="linear")
        ),
        "pb-spectrain-reuse": dict(
            schedule="pb", weight_prediction="spectrain_reuse", optimizer=_sgd(prediction="linear")
        ),
        "pb-pipemare-t2": dict(
            schedule="pb", optimizer=_sgd(discrepancy_correction=True), checkpoint="never"
        ),
        "pb-pipemare-t1": dict(
            schedule="pb", optimizer=_sgd(), lr_scheduler=lambda o: eo.PipeMareLR(o, 5)
        ),
    }
    for kw in out.values():
        kw.setdefault("chunks", M)
    return out


def _train(
    pipe: Any,
    steps: int,
    B: int = 8,
    shard: Callable[[Any], Any] | None = None,
    device: str = "cpu",
) -> list[torch.Tensor]:
    losses = []
    for t in range(steps):
        x, y = batch(t, B)
        if shard is not None:
            x, y = shard(x), shard(y)
        losses.append(pipe.step(x.to(device), y.to(device)).detach().cpu().clone())
    pipe.flush()
    return losses


def _local(
    S: int, kw: dict[str, Any], steps: int, B: int = 8, device: str = "cpu"
) -> tuple[Any, list[torch.Tensor]]:
    from engine import Pipeline

    stages = [f().to(device) for f in stage_factories(S)]
    pipe = Pipeline(stages, loss_fn=nn.functional.mse_loss, **kw)
    return pipe, _train(pipe, steps, B, device=device)


# ---------------------------------------------------------------------- phases


def phase_equal(
    rank: int, S: int, names: list[str] | None, transport: str = "gloo"
) -> dict[str, Any]:
    """Every configuration under gloo (or NCCL) vs the local run: weights and losses."""
    from engine import Pipeline

    device = "cuda" if transport == "nccl" else "cpu"

    out: dict[str, Any] = {}
    for name, kw in configs(S).items():
        if names is not None and name not in names:
            continue
        t0 = time.perf_counter()
        try:
            pipe = Pipeline(
                stage_factories(S),
                loss_fn=nn.functional.mse_loss,
                transport=transport,
                timeout=30,
                **kw,
            )
            losses = _train(pipe, STEPS)  # a rank's inputs may live anywhere: NCCL moves them
            ref, ref_losses = _local(S, kw, STEPS, device=device)
            s = pipe.layout.stage
            mine = [p.detach() for p in pipe.stages[0].module.parameters()]
            theirs = [p.detach() for p in ref.stages[s].module.parameters()]
            diff = max(float((a - b).abs().max()) for a, b in zip(mine, theirs, strict=True))
            out[name] = {
                "weights_equal": all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
                "max_diff": diff,
                "losses_equal": all(
                    torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)
                ),
                "updates": pipe.stages[0].updates,
                "ref_updates": ref.stages[s].updates,
                "delays": list(pipe.delays),
                "ref_delays": list(ref.delays),
                "seconds": time.perf_counter() - t0,
                # bookkeeping a rank keeps must not grow with the number of steps
                "leftovers": len(pipe._executor.inputs)
                + len(pipe._rank.transport._sends),
            }
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def _held(pipe: Any) -> dict[str, int]:
    """The works a rank holds: sends by channel, receives posted ahead, loss messages."""
    tp = pipe._rank.transport
    return {
        "act_sends": sum(1 for ch, _ in tp._sends if ch == "act"),
        "grad_sends": sum(1 for ch, _ in tp._sends if ch == "grad"),
        "posted": len(tp._posted),
        "loss_sends": len(pipe._rank._loss_sends),
    }


def phase_handles(rank: int, S: int, names: list[str], steps: int) -> dict[str, Any]:
    """Asynchronous schedules for ``steps`` steps without a flush: the works held after every
    step (they must not grow with the step count), then a flush and the local run's weights."""
    from engine import Pipeline

    out: dict[str, Any] = {}
    for name in names:
        kw = configs(S)[name]
        t0 = time.perf_counter()
        try:
            pipe = Pipeline(
                stage_factories(S),
                loss_fn=nn.functional.mse_loss,
                transport="gloo",
                timeout=30,
                **kw,
            )
            held, losses = [], []
            for t in range(steps):
                x, y = batch(t)
                losses.append(pipe.step(x, y).detach().clone())
                held.append(_held(pipe))
            pipe.flush()
            flushed = _held(pipe)
            ref, ref_losses = _local(S, kw, steps)
            s = pipe.layout.stage
            mine = [p.detach() for p in pipe.stages[0].module.parameters()]
            theirs = [p.detach() for p in ref.stages[s].module.parameters()]
            out[name] = {
                "held": held,
                "flushed": flushed,
                "M": pipe.chunks,
                "weights_equal": all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
                "losses_equal": all(
                    torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)
                ),
                "updates": pipe.stages[0].updates,
                "ref_updates": ref.stages[s].updates,
                "seconds": time.perf_counter() - t0,
            }
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def phase_data_parallel(rank: int, S: int, R: int) -> dict[str, Any]:
    """R replicas x S stages vs one replica (local) with the R-times larger batch."""
    from engine import Pipeline

    out: dict[str, Any] = {}
    B, M = 4, 2
    for name in ("gpipe", "pipedream"):
        kw = dict(configs(S)[name])
        kw["chunks"] = M
        try:
            pipe = Pipeline(
                stage_factories(S),
                loss_fn=nn.functional.mse_loss,
                transport="gloo",
                data_parallel=R,
                timeout=30,
                **kw,
            )
            d = pipe.layout.replica
            b = B // M

            def shard(t: torch.Tensor, d: int = d, b: int = b) -> torch.Tensor:
                # replica d gets rows d*b .. (d+1)*b-1 of every micro-batch of the big batch
                big = t.split(R * b)
                return torch.cat([mb[d * b : (d + 1) * b] for mb in big])

            losses = _train(pipe, STEPS, B=R * B, shard=shard)
            ref, ref_losses = _local(S, kw, STEPS, B=R * B)
            s = pipe.layout.stage
            mine = [p.detach() for p in pipe.stages[0].module.parameters()]
            theirs = [p.detach() for p in ref.stages[s].module.parameters()]
            out[name] = {
                "max_diff": max(
                    float((a - b).abs().max()) for a, b in zip(mine, theirs, strict=True)
                ),
                "loss_diff": max(
                    float((a - b).abs()) for a, b in zip(losses, ref_losses, strict=True)
                ),
                "moved": max(
                    float((a - f).abs().max())
                    for a, f in zip(mine, stage_factories(S)[s]().parameters(), strict=True)
                ),
                "replica": d,
            }
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def phase_balance(rank: int, S: int) -> dict[str, Any]:
    """balance="time" under gloo: rank 0 profiles and decides, every rank gets the same layer
    counts, and training equals the local run with those counts."""
    from engine import Pipeline

    def model() -> nn.Sequential:
        torch.manual_seed(7)
        return nn.Sequential(
            nn.Linear(DIM, 64),
            nn.Tanh(),
            nn.Linear(64, 64),
            nn.Tanh(),
            nn.Linear(64, DIM),
            nn.Tanh(),
            nn.Linear(DIM, OUT),
        )

    x0, _ = batch(0)
    kw = dict(schedule="1f1b", chunks=4, loss_fn=nn.functional.mse_loss, optimizer=_sgd())
    pipe = Pipeline(
        model(), balance="time", num_stages=S, sample=x0[:2], transport="gloo", timeout=30, **kw
    )
    losses = _train(pipe, 3)
    ref = Pipeline(model(), balance=pipe.balance, **kw)
    ref_losses = _train(ref, 3)
    s = pipe.layout.stage
    return {
        "balance": pipe.balance,
        "equal": all(
            torch.equal(a, b)
            for a, b in zip(
                pipe.stages[0].module.parameters(), ref.stages[s].module.parameters(), strict=True
            )
        ),
        "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)),
    }


def phase_handshake_mismatch(rank: int, S: int) -> dict[str, Any]:
    """Stage 1 expects DIM+1 inputs: every rank raises the same error naming both ranks."""
    from engine import Pipeline

    pipe = Pipeline(
        stage_factories(S, wrong_input_at=1),
        schedule="gpipe",
        chunks=4,
        loss_fn=nn.functional.mse_loss,
        optimizer=_sgd(),
        transport="gloo",
        timeout=20,
    )
    before = [p.detach().clone() for p in pipe.stages[0].module.parameters()]
    x, y = batch(0)
    try:
        pipe.step(x, y)
        return {"error": None}
    except Exception as exc:
        after = list(pipe.stages[0].module.parameters())
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        }


def phase_shape_change(rank: int, S: int) -> dict[str, Any]:
    """A later micro-batch of another shape: the sender names both ranks; the others stop
    within the timeout (terminal phase: the group is unusable afterwards)."""
    from engine import Pipeline

    pipe = Pipeline(
        stage_factories(S),
        schedule="gpipe",
        chunks=4,
        loss_fn=nn.functional.mse_loss,
        optimizer=_sgd(),
        transport="gloo",
        timeout=5,
    )
    t0 = time.perf_counter()
    try:
        pipe.step(*batch(0))
        pipe.step(*batch(1, B=12))  # micro-batches of 3 instead of 2
        return {"type": None}
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "seconds": time.perf_counter() - t0,
        }


def phase_kill(rank: int, S: int, victim: int, timeout: float) -> dict[str, Any]:
    """``victim`` exits abruptly after 2 steps; survivors must raise naming a peer, in time."""
    from engine import Pipeline

    pipe = Pipeline(
        stage_factories(S),
        schedule="pb",
        chunks=4,
        loss_fn=nn.functional.mse_loss,
        optimizer=_sgd(),
        transport="gloo",
        timeout=timeout,
    )
    t0 = time.perf_counter()
    try:
        for t in range(50):
            if t == 2 and rank == victim:
                os._exit(3)  # a crash: no cleanup, no goodbye
            t0 = time.perf_counter()
            pipe.step(*batch(t))
        return {"type": None}
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "seconds": time.perf_counter() - t0,
        }


def phase_stall(rank: int, S: int, victim: int, timeout: float) -> dict[str, Any]:
    """``victim`` stops answering (alive, asleep) for longer than the timeout: its neighbours
    raise after about ``timeout`` seconds naming it (terminal phase)."""
    from engine import Pipeline

    pipe = Pipeline(
        stage_factories(S),
        schedule="1f1b",
        chunks=4,
        loss_fn=nn.functional.mse_loss,
        optimizer=_sgd(),
        transport="gloo",
        timeout=timeout,
    )
    t0 = time.perf_counter()
    try:
        for t in range(4):
            if t == 2 and rank == victim:
                time.sleep(timeout + 4)
                return {"type": "slept"}
            t0 = time.perf_counter()
            pipe.step(*batch(t))
        return {"type": None}
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "seconds": time.perf_counter() - t0,
        }


def tied_stages(S: int) -> list[nn.Module]:
    """A tiny tied language model in S stages: a token embedding in stage 0 whose weight is
    also the output head of the last stage (the same nn.Parameter), every rank building all
    stages from the same seed."""

    class Embed(nn.Module):
        def __init__(self, w: nn.Parameter) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.embed.weight = w

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.embed(x)

    class Head(nn.Module):
        def __init__(self, w: nn.Parameter) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
            self.weight = w

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.body(h) @ self.weight.t()

    torch.manual_seed(77)
    w = nn.Parameter(torch.randn(VOCAB, DIM) * 0.3)
    middle = [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(S - 2)]
    return [Embed(w), *middle, Head(w)]


VOCAB = 11


def token_batch(step: int, B: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(20_000 + step)
    return torch.randint(0, VOCAB, (B,), generator=g), torch.randint(0, VOCAB, (B,), generator=g)


def phase_ties(rank: int, S: int) -> dict[str, Any]:
    """Tied parameters under gloo vs the local run, for the synchronous schedules."""
    from engine import Pipeline

    out: dict[str, Any] = {}
    for schedule in ("gpipe", "1f1b"):
        kw = dict(schedule=schedule, chunks=4, loss_fn=nn.functional.cross_entropy,
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9))
        try:
            pipe = Pipeline(tied_stages(S), transport="gloo", timeout=30, **kw)
            ref = Pipeline(tied_stages(S), **kw)
            for t in range(4):
                x, y = token_batch(t)
                loss = pipe.step(x, y)
                ref_loss = ref.step(x, y)
            s = pipe.layout.stage
            mine = [p.detach().clone() for p in pipe.stages[0].module.parameters()]
            theirs = [p.detach().clone() for p in ref.stages[s].module.parameters()]
            out[schedule] = {
                "weights_equal": all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
                "losses_equal": bool(torch.equal(loss, ref_loss)),
                "tied": [p for n, p in zip(
                    [n for n, _ in pipe.stages[0].module.named_parameters()], mine, strict=True
                ) if n in ("embed.weight", "weight")],
            }
        except Exception:
            out[schedule] = {"error": traceback.format_exc()}
    return out


def phase_evaluate(rank: int, S: int) -> dict[str, Any]:
    """evaluate() mid-run under gloo (an asynchronous pipeline with micro-batches in flight):
    outputs equal the local pipeline's, and training continues bit for bit as without it."""
    from engine import Pipeline

    kw = dict(schedule="pb", chunks=4, optimizer=_sgd())
    try:
        pipe = Pipeline(stage_factories(S), loss_fn=nn.functional.mse_loss, transport="gloo",
                        timeout=30, **kw)
        ref = Pipeline([f() for f in stage_factories(S)], loss_fn=nn.functional.mse_loss, **kw)
        x_eval = batch(99)[0]
        outs, ref_outs = [], []
        for t in range(4):
            x, y = batch(t)
            pipe.step(x, y)
            ref.step(x, y)
            if t == 1:
                outs.append(pipe.evaluate(x_eval))
                ref_outs.append(ref.evaluate(x_eval))
        pipe.flush()
        ref.flush()
        s = pipe.layout.stage
        mine = [p.detach() for p in pipe.stages[0].module.parameters()]
        theirs = [p.detach() for p in ref.stages[s].module.parameters()]
        return {
            "outputs_equal": all(torch.equal(a, b) for a, b in zip(outs, ref_outs, strict=True)),
            "weights_equal": all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
        }
    except Exception:
        return {"error": traceback.format_exc()}


SEQ = 4


class TreeEmbed(nn.Module):
    """Stage 0 of the tree model: keywords in (ids, mask), a dict out with an integer, a
    boolean and a no-grad float leaf and a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.register_buffer("pos", torch.linspace(-1.0, 1.0, SEQ))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        h = torch.tanh(self.embed(ids))
        bias = self.pos.expand(ids.shape[0], SEQ)
        return {"h": h, "mask": mask, "ids": ids, "bias": bias, "scale": 0.5}


class TreeHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.tok = nn.Embedding(VOCAB, 1)
        self.out = nn.Linear(DIM, OUT)

    def forward(self, h, mask, ids, bias, scale):  # the leaves of stage 0's dict
        h = torch.tanh(self.lin(h) + scale * bias.unsqueeze(-1) + self.tok(ids))
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.out((h * m).sum(1) / m.sum(1).clamp_min(1.0))


class TreeFeatures(nn.Module):
    """A stage 0 whose output needs no gradient (its parameter is used detached), so no
    gradient travels back to it."""

    def __init__(self) -> None:
        super().__init__()
        self.freq = nn.Parameter(torch.arange(1.0, DIM + 1.0))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        h = torch.cos(ids.unsqueeze(-1) * self.freq.detach())
        bias = torch.linspace(-1.0, 1.0, SEQ).expand(ids.shape[0], SEQ)
        return {"h": h, "mask": mask, "ids": ids, "bias": bias, "scale": 0.5}


def tree_factories(first: type[nn.Module] = TreeEmbed) -> list[Callable[[], nn.Module]]:
    def make(s: int) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            torch.manual_seed(3000 + s)
            return first() if s == 0 else TreeHead()

        return build

    return [make(0), make(1)]


def tree_batch(step: int, B: int = 8) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(30_000 + step)
    mask = torch.rand(B, SEQ, generator=g) > 0.3
    mask[:, 0] = True
    ids = torch.randint(0, VOCAB, (B, SEQ), generator=g)
    return {"ids": ids, "mask": mask}, {"y": torch.randn(B, OUT, generator=g)}


def _tree_loss(out: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(out, t["y"])


def phase_trees(rank: int, S: int) -> dict[str, Any]:
    """Stages passing dicts of tensors (bool mask, int ids, a no-grad float, a constant) under
    gloo vs the local run of the same configuration."""
    from engine import Pipeline

    assert S == 2, "the tree model has two stages"
    out: dict[str, Any] = {}
    for name in ("gpipe", "1f1b", "pipedream", "pb", "pb-nograd"):
        schedule, _, variant = name.partition("-")
        first = TreeFeatures if variant == "nograd" else TreeEmbed
        kw = dict(schedule=schedule, chunks=4, loss_fn=_tree_loss, optimizer=_sgd())
        try:
            pipe = Pipeline(tree_factories(first), transport="gloo", timeout=30, **kw)
            ref = Pipeline([f() for f in tree_factories(first)], **kw)
            losses, ref_losses = [], []
            for t in range(4):
                x, y = tree_batch(t)
                losses.append(pipe.step(x, y).detach().clone())
                ref_losses.append(ref.step(x, y).detach().clone())
            pipe.flush()
            ref.flush()
            s = pipe.layout.stage
            mine = [p.detach() for p in pipe.stages[0].module.parameters()]
            theirs = [p.detach() for p in ref.stages[s].module.parameters()]
            tp = pipe._rank.transport
            sent = tp.meta.get(("act", "send"))
            grads = tp.meta.get(("grad", "send"))
            out[name] = {
                "weights_equal": all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
                "losses_equal": all(
                    torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)
                ),
                "updates": pipe.stages[0].updates,
                "ref_updates": ref.stages[s].updates,
                "sent": None if sent is None else [
                    (p, m.shape, m.dtype, m.requires_grad) for p, m in sent.metas(grad=False)
                ],
                "grads_sent": None if grads is None else [p for p, _ in grads.metas(grad=True)],
                "leftovers": len(tp._sends) + len(tp._posted),
            }
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def phase_disagree(rank: int, S: int, key: str) -> dict[str, Any]:
    """Rank 1 starts with another setting than the others: every rank must fail at
    construction, naming the setting, instead of hanging at the first step."""
    from engine import Pipeline

    kw: dict[str, Any] = dict(schedule="1f1b", chunks=4, optimizer=_sgd())
    if rank == 1:
        kw.update({"chunks": {"chunks": 2}, "schedule": {"schedule": "gpipe"},
                   "prediction": {"schedule": "pb", "optimizer": _sgd(prediction="linear")}}[key])
        if key == "prediction":
            pass
    elif key == "prediction":
        kw.update(schedule="pb")
    t0 = time.perf_counter()
    try:
        Pipeline(stage_factories(S), loss_fn=nn.functional.mse_loss, transport="gloo", timeout=30, **kw)
        return {"error": None, "seconds": time.perf_counter() - t0}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}


def phase_parameterless(rank: int, S: int) -> dict[str, Any]:
    """A stage without parameters (no optimizer) under gloo: the ranks still agree, and the
    run equals the local one."""
    from engine import Pipeline

    def stages() -> list[nn.Module]:
        torch.manual_seed(5)
        return [nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, OUT)][:S]

    kw = dict(schedule="1f1b", chunks=4, optimizer=_sgd(spike_compensation=False))
    try:
        pipe = Pipeline(stages(), loss_fn=nn.functional.mse_loss, transport="gloo", timeout=30, **kw)
        ref = Pipeline(stages(), loss_fn=nn.functional.mse_loss, **kw)
        for t in range(3):
            x, y = batch(t)
            loss, ref_loss = pipe.step(x, y), ref.step(x, y)
        s = pipe.layout.stage
        mine = [p.detach() for p in pipe.stages[0].module.parameters()]
        theirs = [p.detach() for p in ref.stages[s].module.parameters()]
        return {"equal": bool(torch.equal(loss, ref_loss))
                and all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))}
    except Exception:
        return {"error": traceback.format_exc()}


# ---------------------------------------------------------------------- spawning


def _worker(
    rank: int, world: int, port: int, phases: list[tuple[str, dict[str, Any]]], outdir: str
) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    results: dict[str, Any] = {}
    path = os.path.join(outdir, f"rank{rank}.pt")
    backend = "nccl" if any(kw.get("transport") == "nccl" for _, kw in phases) else "gloo"
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
        for name, kw in phases:
            t0 = time.perf_counter()
            results[name] = globals()[f"phase_{name}"](rank, **kw)
            results[name + ".seconds"] = time.perf_counter() - t0
            torch.save(results, path)  # keep what we have if a later phase kills us
    except Exception:
        results["fatal"] = traceback.format_exc()
    torch.save(results, path)
    os._exit(0)  # skip destroy_process_group: peers may be gone on purpose


def spawn(
    world: int, phases: list[tuple[str, dict[str, Any]]], timeout: float = 240.0
) -> list[dict[str, Any]]:
    """Run ``phases`` on ``world`` gloo ranks; return each rank's results (missing: {})."""
    outdir = tempfile.mkdtemp(prefix="engine-dist-")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, phases, outdir)) for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():  # only our own children, by handle
            p.kill()
            p.join(5)
    out = []
    for r in range(world):
        path = os.path.join(outdir, f"rank{r}.pt")
        out.append(torch.load(path, weights_only=False) if os.path.exists(path) else {})
    return out


def phase_resume_inflight(rank: int, S: int, names: list[str], k: int, steps: int) -> dict[str, Any]:
    """Each rank saves its unflushed stage at step k (pipe.state_dict() in memory), the run
    continues; a fresh pipeline loads the state and runs the same steps: losses, weights and
    optimizer state must be equal bit for bit (engine.runtime.inflight)."""
    from engine import Pipeline

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()))

    def tensors(pipe: Any) -> list[torch.Tensor]:
        st = pipe.stages[0]
        out = [t.detach().clone() for t in st.module.state_dict().values()]
        for s in st.optimizer.state.values():
            out += [v.clone() for v in s.values() if isinstance(v, torch.Tensor)]
        return out

    out: dict[str, Any] = {}
    for name in names:
        kw = configs(S)[name]
        try:
            def make(kw: dict[str, Any] = kw) -> Any:
                return Pipeline(
                    stage_factories(S), loss_fn=nn.functional.mse_loss, transport="gloo",
                    timeout=30, **kw,
                )

            a = make()
            la = [a.step(*batch(t)).clone() for t in range(k)]
            state = a.state_dict()
            la += [a.step(*batch(t)).clone() for t in range(k, steps)]
            a.flush()
            b = make()
            b.load_state_dict(state)
            lb = [b.step(*batch(t)).clone() for t in range(k, steps)]
            b.flush()
            ta, tb = tensors(a), tensors(b)
            out[name] = {
                "in_flight": "in_flight" in state,
                "losses_equal": all(same(x, y) for x, y in zip(la[k:], lb, strict=True)),
                "state_equal": len(ta) == len(tb) and all(
                    torch.equal(x, y) for x, y in zip(ta, tb, strict=True)
                ),
            }
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out
