"""The runtime executes the schedule IR's streams: the actions it runs (recorded by the
executor, communication included) are ``engine.schedule.generate``'s lists, and the delays it
sets on the optimizers are docs/ALGORITHMS.md's table."""

from __future__ import annotations

import pytest
import torch
from schedules import FREE_UPDATE_SIZE, SYNC, VARIANTS, chunks_for, variant
from torch import nn

import engine.schedule as schedule_ir
from engine import Pipeline
from engine.runtime.exec.program import OP_NAMES, StepCompiler
from engine.schedule import Kind, stage_actions, truncate
from engine.schedule.spec import resolve_schedule

CASES = [
    (name, order, S, M, k)
    for name, order in map(variant, VARIANTS)
    for S in (1, 2, 3, 4)
    for M in sorted({1, S, 2 * S + 1})
    for k in ((None, 2) if name in FREE_UPDATE_SIZE else (None,))
    if chunks_for(name, S, M) == M
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


def _absolute(prog, base: int) -> list[list[str]]:
    out = []
    for ops in prog.stages:
        row = []
        for op, rel in ops:
            if OP_NAMES[op] == "U":
                row.append(str(schedule_ir.Action.update([base + m for m in rel])))
            else:
                row.append(f"{OP_NAMES[op]}{base + rel}")
        out.append(row)
    return out


@pytest.mark.parametrize("name,order,S,M,k", CASES)
def test_executed_actions_equal_schedule_ir(
    name: str, order: str | None, S: int, M: int, k: int | None
) -> None:
    """T steps and a flush run exactly ``generate``'s lists: the compiled programs (with their
    communication) concatenate to them, and what the executor ran in one process is their
    compute and update actions in each stage's order."""
    T = 4 if k is None else 2 * k  # the IR requires k | T*M
    sched = schedule_ir.generate(name, stages=S, chunks=M, steps=T, update_size=k, order=order)
    spec = resolve_schedule(name, stages=S, chunks=M, update_size=k, order=order)
    compiler = StepCompiler(spec)
    programs = [(compiler.step(j), j * M) for j in range(T)]
    if not spec.synchronous:
        programs.append((compiler.drain(T), T * M))
    rows: list[list[str]] = [[] for _ in range(S)]
    for prog, base in programs:
        for s, row in enumerate(_absolute(prog, base)):
            rows[s] += row
    for s in range(S):
        assert rows[s] == [str(a) for a in sched.actions[s]], f"stage {s}"
    pipe = _pipe(name, order, S, M, k)
    pipe.parts.executor.log = []
    g = torch.Generator().manual_seed(1)
    for _ in range(T):
        pipe.step(torch.randn(M, 2, generator=g), torch.randn(M, 2, generator=g))
    pipe.flush()
    ran = [[a for s2, a in pipe.parts.executor.log if s2 == s] for s in range(S)]
    for s in range(S):
        compute = [a for a in sched.actions[s] if not a.kind.is_comm]
        assert ran[s] == compute, f"stage {s}"


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


#: D_s for k = 1 as docs/ALGORITHMS.md's table writes it (not as the engine computes it)
TABLE_DELAYS = {
    ("naive", None): lambda S, s: 0,
    ("gpipe", None): lambda S, s: 0,
    ("1f1b", None): lambda S, s: 0,
    ("zbh1", None): lambda S, s: 0,
    ("pipedream", None): lambda S, s: S - 1 - s,
    ("2bw", None): lambda S, s: 1,
    ("pb", None): lambda S, s: 2 * (S - 1 - s),  # dataflow ticks
    ("pb", "1f1b"): lambda S, s: S - 1 - s,
}


@pytest.mark.parametrize("name,order,S,M", sorted({c[:4] for c in CASES}, key=str))
def test_delays_are_the_documented_ones(name: str, order: str | None, S: int, M: int) -> None:
    """The delays the pipeline sets on its optimizers are the table's formulas, derived by
    simulation (pipeline.py) but checked against values written independently here."""
    pipe = _pipe(name, order, S, M, None)
    want = [TABLE_DELAYS[(name, order)](S, s) for s in range(S)]
    assert pipe.delays == want
    assert [st.optimizer.param_groups[0]["delay"] for st in pipe.stages] == want
    if name in SYNC:
        assert want == [0] * S


@pytest.mark.parametrize("S,k", [(2, 2), (3, 2), (4, 3), (4, 4)])
def test_delay_with_k_is_steady_state_max(S: int, k: int) -> None:
    """One definition of D_s for k > 1: the analysis' maximum, ceil(lag / k)."""
    d = schedule_ir.schedule_delays("pb", S, 1, update_size=k)
    assert d == tuple(-(-2 * (S - 1 - s) // k) for s in range(S))
    d = schedule_ir.schedule_delays("pipedream", S, 1, update_size=k)
    assert d == tuple(-(-(S - 1 - s) // k) for s in range(S))


@pytest.mark.parametrize(
    "name,order,S,M,k",
    [c for c in CASES if c[0] not in SYNC][::2],
)
def test_periodic_programs_equal_long_schedules(
    name: str, order: str | None, S: int, M: int, k: int | None
) -> None:
    """Past the fill the compiler reuses one period of step programs; replayed over many
    steps (and drained at several points) they still equal ``generate``'s lists."""
    spec = resolve_schedule(name, stages=S, chunks=M, update_size=k, order=order)
    compiler = StepCompiler(spec)
    T = 3 * (compiler._settle + 2 * compiler._P) + 1
    T += (-T * M) % spec.update_size // M if spec.update_size % M == 0 else 0
    while (T * M) % spec.update_size:
        T += 1
    sched = schedule_ir.generate(name, stages=S, chunks=M, steps=T, update_size=k, order=order)
    rows: list[list[str]] = [[] for _ in range(S)]
    for j in range(T):
        for s, row in enumerate(_absolute(compiler.step(j), j * M)):
            rows[s] += row
    for s, row in enumerate(_absolute(compiler.drain(T), T * M)):
        rows[s] += row
    for s in range(S):
        assert rows[s] == [str(a) for a in sched.actions[s]], f"stage {s}"
    assert compiler._period is not None
    compiled = compiler.compiled
    for j in range(T, 3 * T):
        compiler.step(j)
    assert compiler.compiled == compiled  # steady state: nothing new to compile


def test_pipeline_compiles_its_programs_once() -> None:
    """A counter: after the fill, steps reuse compiled programs (stats()["compiled_programs"])."""
    pipe = _pipe("pb", None, 4, 2, None)
    g = torch.Generator().manual_seed(1)
    counts = []
    for _ in range(40):
        pipe.step(torch.randn(2, 2, generator=g), torch.randn(2, 2, generator=g))
        counts.append(pipe.stats()["compiled_programs"])
    assert counts[-1] == counts[len(counts) // 2] <= 12
    sync = _pipe("1f1b", None, 3, 4, None)
    for _ in range(10):
        sync.step(torch.randn(4, 2, generator=g), torch.randn(4, 2, generator=g))
    assert sync.stats()["compiled_programs"] <= 3
