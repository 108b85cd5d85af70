"""Interleaved 1F1B in one process: the S*v virtual stages run as stage modules, equal to the
unpipelined model (and bit for bit to 1f1b on the same stages: the same per-stage order of
micro-batches), weight versions of a synchronous schedule. Under gloo: test_distributed_gloo.py."""

from __future__ import annotations

import copy

import pytest
import torch
from test_runtime_support import History, reads
from test_runtime_sync import _model
from test_runtime_trees import ProbeStage
from test_runtime_versions import check_versions, run
from torch import nn

from engine import Pipeline, PipelineConfigError
from engine.schedule import analyze, format_schedule, interleaved
from engine.schedule.lower import add_comms
from engine.schedule.text import strip

# (ranks, v, M)
CASES = [(1, 2, 1), (1, 2, 3), (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 3, 4), (3, 2, 3), (4, 2, 8)]


def _pipe(stages: list[nn.Module], M: int | None, **kw) -> Pipeline:
    kw.setdefault(
        "optimizer", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)
    )
    return Pipeline(stages, chunks=M, loss_fn=nn.functional.mse_loss, **kw)


@pytest.mark.parametrize("R,v,M", CASES)
def test_interleaved_equals_unpipelined_and_1f1b(R: int, v: int, M: int) -> None:
    S = R * v
    checkpoint = ["never", "except_last", "always"][(S + M) % 3]
    stages, twin = _model(S), _model(S)
    ref = nn.Sequential(*copy.deepcopy(stages))
    pipe = _pipe(stages, M, schedule="interleaved", virtual_stages=v, checkpoint=checkpoint)
    flat = _pipe(twin, M, schedule="1f1b", checkpoint=checkpoint)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(2 * M, 4, generator=g), torch.randn(2 * M, 2, generator=g)
        loss = pipe.step(x, y)
        assert torch.equal(loss, flat.step(x, y))
        ropt.zero_grad()
        rloss = nn.functional.mse_loss(ref(x), y)
        rloss.backward()
        ropt.step()
        torch.testing.assert_close(loss, rloss.detach(), rtol=1e-6, atol=1e-7)
    mine = [p for st in stages for p in st.parameters()]
    for a, b, c in zip(mine, ref.parameters(), [p for st in twin for p in st.parameters()], strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(a, c)
    stats = pipe.stats()
    assert stats["delays"] == [0] * S and stats["updates"] == [3] * S
    assert pipe.spec.program == interleaved(R, v, M)
    assert stats["bubble_fraction"] == pytest.approx(analyze(interleaved(R, v, M)).bubble_fraction)


@pytest.mark.parametrize("R,v,M", [(2, 2, 4), (3, 2, 1)])
def test_interleaved_probe_versions(R: int, v: int, M: int) -> None:
    """Every micro-batch's F and B read the weights of its own mini-batch (the 1f1b table)."""
    pipe, got, hist, N = run(
        R * v, M, "interleaved", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        virtual_stages=v, checkpoint="except_last",
    )
    check_versions(pipe, got, hist, N, "1f1b")


def test_interleaved_probe_versions_with_tree_stages() -> None:
    """Tuple activations (a float mask that needs no gradient) through 4 virtual stages."""
    S, M, steps = 4, 2, 3
    torch.manual_seed(0)
    mods = [ProbeStage(s, s == S - 1) for s in range(S)]
    hist = History(S)
    pipe = _pipe(
        mods, M, schedule="interleaved", virtual_stages=2, trace=True, checkpoint="except_last",
        optimizer=hist.factory(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    )
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(M, 3, generator=g)
        mask = (torch.rand(M, 3, generator=g) > 0.2).float()
        pipe.step((x, mask), torch.randn(M, 1, generator=g))
    check_versions(pipe, reads([m.probe for m in mods]), hist, steps * M, "1f1b")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(schedule="interleaved"), "needs virtual_stages"),
        (dict(schedule="interleaved", virtual_stages=3), "dividing the number of stage modules"),
        (dict(schedule="interleaved", virtual_stages=2, update_size=2), "update_size must equal"),
        (dict(schedule="interleaved", virtual_stages=2, order="1f1b"), "its own order"),
        (dict(schedule="1f1b", virtual_stages=2), "only for schedule='interleaved'"),
    ],
)
def test_bad_options_are_refused(kw: dict, match: str) -> None:
    stages = _model(4)
    before = [p.detach().clone() for st in stages for p in st.parameters()]
    with pytest.raises(PipelineConfigError, match=match):
        _pipe(stages, 4, **kw)
    assert all(torch.equal(a, b) for a, b in zip(before, [p for st in stages for p in st.parameters()], strict=True))


def test_compact_program_lowers_to_the_generated_one() -> None:
    """A hand-written compute-only interleaved program gets its sends and receives, and its
    rank order grows with them: it lowers to the generator's program and trains the same."""
    sched = interleaved(2, 2, 4)
    compact = strip(sched, comms=False, ticks=False)
    lowered = add_comms(compact)
    assert lowered.actions == sched.actions and lowered.rank_order == sched.rank_order
    a, b = _model(4), _model(4)
    built_in = _pipe(a, 4, schedule="interleaved", virtual_stages=2)
    program = _pipe(b, None, schedule=format_schedule(compact))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    assert torch.equal(built_in.step(x, y), program.step(x, y))
    assert all(torch.equal(p, q) for p, q in zip(
        [p for st in a for p in st.parameters()], [p for st in b for p in st.parameters()],
        strict=True,
    ))
