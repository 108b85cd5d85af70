"""The runtime executes the schedule IR's streams: the actions it runs (recorded by the
executor, communication included) are ``engine.schedule.generate``'s lists, and the delays it
sets on the optimizers are ``engine.schedule.analyze``'s."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.schedule as schedule_ir
from engine.runtime import Pipeline
from engine.runtime.plan import SYNC_SCHEDULES
from engine.schedule import Kind, stage_actions, truncate

CASES = [
    (name, order, S, M, k)
    for name, order in [
        ("naive", None),
        ("gpipe", None),
        ("1f1b", None),
        ("pipedream", None),
        ("2bw", None),
        ("pb", None),
        ("pb", "1f1b"),
    ]
    for S in (1, 2, 3, 4)
    for M in sorted({1, S, 2 * S + 1})
    for k in ((None, 2) if name in ("pipedream", "pb") else (None,))
    if not (name == "2bw" and M < S)
]


def _pipe(name: str, order: str | None, S: int, M: int, k: int | None) -> Pipeline:
    torch.manual_seed(0)
    return Pipeline(
        [nn.Linear(2, 2) for _ in range(S)],
        schedule=name,
        chunks=M,
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        update_size=k,
        order=order,
        checkpoint="never",
    )


@pytest.mark.parametrize("name,order,S,M,k", CASES)
def test_executed_actions_equal_schedule_ir(
    name: str, order: str | None, S: int, M: int, k: int | None
) -> None:
    T = 4 if k is None else 2 * k  # the IR requires k | T*M
    sched = schedule_ir.generate(name, stages=S, chunks=M, steps=T, update_size=k, order=order)
    pipe = _pipe(name, order, S, M, k)
    pipe._executor.log = []
    g = torch.Generator().manual_seed(1)
    for _ in range(T):
        pipe.step(torch.randn(M, 2, generator=g), torch.randn(M, 2, generator=g))
    pipe.flush()
    ran = [[a for s2, a in pipe._executor.log if s2 == s] for s in range(S)]
    for s in range(S):
        assert ran[s] == list(sched.actions[s]), f"stage {s}"


@pytest.mark.parametrize("name,order,S,M,k", CASES[::3])
def test_truncated_stream_is_generate(
    name: str, order: str | None, S: int, M: int, k: int | None
) -> None:
    T = 3 if k is None else 2 * k
    sched = schedule_ir.generate(name, stages=S, chunks=M, steps=T, update_size=k, order=order)
    for s in range(S):
        acts = list(truncate(stage_actions(name, s, S, M, k, order), T * M))
        assert tuple(acts) == sched.actions[s]
        assert all(a.kind is not Kind.UPDATE or len(a.mbs) == sched.update_size for a in acts)


@pytest.mark.parametrize("name,order,S,M", sorted({c[:4] for c in CASES}, key=str))
def test_delays_match_schedule_analysis(name: str, order: str | None, S: int, M: int) -> None:
    pipe = _pipe(name, order, S, M, None)
    T = max(8, 4 * S)
    report = schedule_ir.analyze(
        schedule_ir.generate(name, stages=S, chunks=M, steps=T, order=order)
    )
    assert tuple(pipe.delays) == report.delays
    assert [st.optimizer.param_groups[0]["delay"] for st in pipe.stages] == pipe.delays
    if name in SYNC_SCHEDULES:
        assert pipe.delays == [0] * S


@pytest.mark.parametrize("S,k", [(2, 2), (3, 2), (4, 3), (4, 4)])
def test_delay_with_k_is_steady_state_max(S: int, k: int) -> None:
    """One definition of D_s for k > 1: the analysis' maximum, ceil(lag / k)."""
    d = schedule_ir.schedule_delays("pb", S, 1, update_size=k)
    assert d == tuple(-(-2 * (S - 1 - s) // k) for s in range(S))
    d = schedule_ir.schedule_delays("pipedream", S, 1, update_size=k)
    assert d == tuple(-(-(S - 1 - s) // k) for s in range(S))
