"""Ties between stages built by factories (issue 21): factories cannot share a parameter
object, so a tie is declared (``Pipeline(ties=[["0:embed.weight", "3:weight"]])``), checked at
build time (the parameter exists, one shape and dtype on every rank), started from the
owner's values and trained as the object-tied model (pipedream too, tie_carry.py): locally
and under gloo bit for bit. Wrong declarations are refused naming the holder."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_support import RANKS, spawn, tied_stages, token_batch
from ties_support import _kw, declaration, tied_factories

from engine import Pipeline
from engine.errors import PipelineConfigError


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1"])
def test_declared_tie_trains_the_tied_model(schedule: str) -> None:
    pipe = Pipeline(tied_factories(3, head_seed=5), ties=declaration(3), **_kw(schedule))
    ref = Pipeline(tied_stages(3), **_kw(schedule))
    assert [g.holders for g in pipe.ties] == [[(0, "embed.weight"), (2, "weight")]]
    for t in range(4):
        assert torch.equal(pipe.step(*token_batch(t)), ref.step(*token_batch(t)))
    for a, b in zip(pipe.stages, ref.stages, strict=True):
        for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
            assert torch.equal(p, q)
    assert torch.equal(pipe.stages[0].module.embed.weight, pipe.stages[2].module.weight)


def test_undeclared_factory_tie_is_not_a_tie() -> None:
    """Without the declaration the copies are separate parameters (the documented reason
    to declare): they drift apart."""
    pipe = Pipeline(tied_factories(3), **_kw("gpipe"))
    assert pipe.ties == []
    for t in range(2):
        pipe.step(*token_batch(t))
    assert not torch.equal(pipe.stages[0].module.embed.weight, pipe.stages[2].module.weight)


@pytest.mark.parametrize(
    "ties,match",
    [
        ([["0:embed.weight", "2:nope"]], "stage 2 has no parameter 'nope'"),
        ([["0:embed.weight", "0:embed.weight"]], "twice"),
        ([["0:embed.weight"]], "at least two different stages"),
        ([["0:embed.weight", "7:weight"]], "stages 0..2"),
        ([["embed.weight", "2:weight"]], "is not 'stage:parameter'"),
        ("0:embed.weight", "give a list of groups"),
        ([["0:embed.weight", "2:body.0.weight"]], "same shape and dtype"),
    ],
)
def test_bad_declarations_are_refused(ties: Any, match: str) -> None:
    with pytest.raises(PipelineConfigError, match=match):
        Pipeline(tied_factories(3), ties=ties, **_kw("gpipe"))


def test_declared_tie_on_an_asynchronous_schedule_carries_the_owner_value() -> None:
    """pipedream: the declared head leaves its module and reads the owner's value, so the
    run equals the object-tied one bit for bit (tests/runtime/ties/test_runtime_ties_async.py)."""
    pipe = Pipeline(tied_factories(3, head_seed=5), ties=declaration(3), **_kw("pipedream"))
    ref = Pipeline(tied_stages(3), **_kw("pipedream"))
    assert pipe.ties[0].carried and "weight" not in dict(pipe.stages[2].module.named_parameters())
    for t in range(3):
        assert torch.equal(pipe.step(*token_batch(t)), ref.step(*token_batch(t)))


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_declared_tie_under_gloo() -> None:
    results = spawn(RANKS, [("ties_support.declared", dict(S=RANKS))])
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        r = res["ties_support.declared"]
        for schedule in ("gpipe", "1f1b", "pipedream"):
            got = r[schedule]
            assert "error" not in got, f"rank {rank}: {got['error']}"
            assert got["weights_equal"] and got["losses_equal"], (rank, schedule)
            assert got["ties"] == [[(0, "embed.weight"), (RANKS - 1, "weight")]]
        assert r["shape"]["type"] == "PipelineConfigError", (rank, r["shape"])
        assert "the shape and dtype of tied" in r["shape"]["message"], r["shape"]["message"]
