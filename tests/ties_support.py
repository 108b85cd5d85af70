"""Declared ties between factory-built stages (``Pipeline(ties=...)``): the factories and
what each rank runs (tests/runtime/ties/test_runtime_ties_declared.py; spawned as ``ties_support.<name>``).

Why factories built the GPT-2 way: each factory builds the whole tied model and returns its
stage, so the last stage's head holds a parameter *object* of its own (another process's, or
another call's) whose values equal the embedding's; the tie exists only by declaration.
"""

from __future__ import annotations

from distributed_support import transport_under_test

import traceback
from collections.abc import Callable
from typing import Any

import torch
from distributed_support import tied_stages, token_batch
from torch import nn


def tied_factories(S: int, head_seed: int | None = None) -> list[Callable[[], nn.Module]]:
    """Stage s of :func:`tied_stages` per factory; ``head_seed``: the last stage's head weight
    drawn otherwise (the declared tie must start it from the owner's values)."""

    def make(s: int) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            m = tied_stages(S)[s]
            if s == S - 1 and head_seed is not None:
                g = torch.Generator().manual_seed(head_seed)
                m.weight = nn.Parameter(torch.randn(m.weight.shape, generator=g))
            return m

        return build

    return [make(s) for s in range(S)]


def declaration(S: int) -> list[list[str]]:
    return [["0:embed.weight", f"{S - 1}:weight"]]


def _kw(schedule: str) -> dict[str, Any]:
    return dict(schedule=schedule, chunks=4, loss_fn=nn.functional.cross_entropy,
                optimizer=lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9))


def declared(rank: int, S: int, steps: int = 4) -> dict[str, Any]:
    """Declared ties under gloo vs the local object-tied model (bitwise; pipedream carries
    the owner's value, tie_carry.py), and a shape that differs between the holders' ranks
    (refused)."""
    from engine import Pipeline

    out: dict[str, Any] = {}
    for schedule in ("gpipe", "1f1b", "pipedream"):
        try:
            pipe = Pipeline(tied_factories(S, head_seed=5), transport=transport_under_test(), timeout=30,
                            ties=declaration(S), **_kw(schedule))
            ref = Pipeline(tied_stages(S), **_kw(schedule))
            for t in range(steps):
                loss, ref_loss = pipe.step(*token_batch(t)), ref.step(*token_batch(t))
            s = pipe.layout.stage
            mine = [p.detach().clone() for p in pipe.stages[0].module.parameters()]
            theirs = [p.detach().clone() for p in ref.stages[s].module.parameters()]
            out[schedule] = {
                "weights_equal": all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
                "losses_equal": bool(torch.equal(loss, ref_loss)),
                "ties": [g.holders for g in pipe.ties],
            }
        except Exception:
            out[schedule] = {"error": traceback.format_exc()}
    for case in ("shape",):
        try:
            factories = tied_factories(S)
            if case == "shape" and rank == S - 1:  # this rank's head is (VOCAB, DIM + 1)
                def wider() -> nn.Module:
                    m = tied_stages(S)[S - 1]
                    m.weight = nn.Parameter(torch.zeros(m.weight.shape[0], m.weight.shape[1] + 1))
                    return m

                factories[S - 1] = wider
            Pipeline(factories, transport=transport_under_test(), timeout=30, ties=declaration(S),
                     **_kw("gpipe"))
            out[case] = {"error": "not refused"}
        except Exception as exc:
            out[case] = {"type": type(exc).__name__, "message": str(exc)}
    return out


def module_tied_stages(S: int) -> list[nn.Module]:
    """:func:`tied_stages` written with a shared *module*: the last stage holds the same
    ``nn.Embedding`` object as stage 0 and computes its logits with ``F.linear(h,
    emb.weight)`` (the same values, parameter names ``embed.weight`` and ``emb.weight``)."""
    first, *middle, last = tied_stages(S)

    class Head(nn.Module):
        def __init__(self, emb: nn.Embedding, body: nn.Module) -> None:
            super().__init__()
            self.body = body
            self.emb = emb

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(self.body(h), self.emb.weight)

    return [first, *middle, Head(first.embed, last.body)]


ASYNC_GLOO = {
    "pipedream": dict(schedule="pipedream"),
    "pb-lwp": dict(schedule="pb", prediction="linear"),
    "pb-t2": dict(schedule="pb", discrepancy_correction=True),
    "pb-sc-skip": dict(schedule="pb", spike_compensation=True, on_nonfinite="skip_update"),
    "2bw": dict(schedule="2bw"),
    "module-pb": dict(schedule="pb", module=True),
    "declared-pipedream": dict(schedule="pipedream", declared=True),
    "module-gpipe": dict(schedule="gpipe", module=True),  # (synchronous: copies, ties.py)
    "module-1f1b": dict(schedule="1f1b", module=True),
}


def ties_async(rank: int, S: int, steps: int = 4, only: list[str] | None = None) -> dict[str, Any]:
    """Tied weights on asynchronous schedules, and a shared module on synchronous ones, under
    gloo (owner and head on different ranks) vs the local run with the same tie: weights and
    losses bit for bit."""
    import engine.optim as eo
    from engine import Pipeline

    out: dict[str, Any] = {}
    for name, case in ASYNC_GLOO.items():
        if only is not None and name not in only:
            continue
        case = dict(case)
        schedule = case.pop("schedule")
        module, decl = case.pop("module", False), case.pop("declared", False)
        on_nonfinite = case.pop("on_nonfinite", "raise")
        kw = dict(schedule=schedule, chunks=4, loss_fn=nn.functional.cross_entropy,
                  on_nonfinite=on_nonfinite, checkpoint="always" if "t2" in name else "never",
                  optimizer=lambda p, c=case: eo.SGD(p, lr=0.2, momentum=0.9, weight_decay=0.01, **c))
        try:
            if decl:
                pipe = Pipeline(tied_factories(S, head_seed=5), transport=transport_under_test(), timeout=30,
                                ties=declaration(S), **kw)
            else:
                pipe = Pipeline((module_tied_stages if module else tied_stages)(S),
                                transport=transport_under_test(), timeout=30, **kw)
            ref = Pipeline((module_tied_stages if module else tied_stages)(S), **kw)
            losses = []
            for t in range(steps):
                losses.append((pipe.step(*token_batch(t)), ref.step(*token_batch(t))))
            pipe.flush()
            ref.flush()
            x_eval = token_batch(99)[0]  # evaluate(): the head reads the carried live value
            evaluated = bool(torch.equal(pipe.evaluate(x_eval), ref.evaluate(x_eval)))
            s = pipe.layout.stage
            mine = [p.detach().clone() for p in pipe.stages[0].module.parameters()]
            theirs = [p.detach().clone() for p in ref.stages[s].module.parameters()]
            out[name] = {
                "weights_equal": len(mine) == len(theirs)
                and all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
                "losses_equal": all(torch.equal(a, b) for a, b in losses) and evaluated,
                "carried": [g.carried for g in pipe.ties],
            }
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def ties_replicas(rank: int, S: int, R: int, steps: int = 4) -> dict[str, Any]:
    """Asynchronous ties with R data-parallel replicas of S stages: each replica's owner
    averages the tied gradient (head contribution included) with its other gradients, so the
    run equals one replica on the R-times larger batch (within the rounding of the mean)."""
    from distributed_support import replica_rows

    import engine.optim as eo
    from engine import Pipeline

    out: dict[str, Any] = {}
    B = 8
    for schedule in ("pipedream", "pb"):
        kw = dict(schedule=schedule, chunks=4, loss_fn=nn.functional.cross_entropy,
                  optimizer=lambda p: eo.SGD(p, lr=0.2, momentum=0.9))
        try:
            pipe = Pipeline(tied_stages(S), transport=transport_under_test(), data_parallel=R, timeout=30, **kw)
            ref = Pipeline(tied_stages(S), **kw)
            shard = replica_rows(pipe.layout.replica, R, B // 4)
            for t in range(steps):
                x, y = token_batch(t, R * B)
                pipe.step(shard(x), shard(y))
                ref.step(x, y)
            pipe.flush()
            ref.flush()
            s = pipe.layout.stage
            mine = [p.detach() for p in pipe.stages[0].module.parameters()]
            theirs = [p.detach() for p in ref.stages[s].module.parameters()]
            out[schedule] = {
                "count": (len(mine), len(theirs)),
                "max_diff": max(float((a - b).abs().max()) for a, b in zip(mine, theirs, strict=True)),
            }
        except Exception:
            out[schedule] = {"error": traceback.format_exc()}
    return out
