"""The runtime's per-stage streams are the schedule IR's action lists, and the delays it derives
by simulation match both ALGORITHMS.md's formulas and engine.schedule's own analysis."""

from __future__ import annotations

import pytest

from engine.runtime.plan import SYNC_SCHEDULES, derive_delays, stage_stream

schedule_ir = pytest.importorskip("engine.schedule")

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


def runtime_actions(
    name: str, order: str | None, s: int, S: int, M: int, k: int, T: int
) -> list[tuple[str, tuple[int, ...]]]:
    """What the executor runs on stage s for T mini-batches followed by a flush."""
    N = T * M
    out: list[tuple[str, tuple[int, ...]]] = []
    if name in SYNC_SCHEDULES:
        for t in range(T):
            mbs = []
            for a in stage_stream(name, s, S, M, k, order):
                out.append((a.kind, (a.i + t * M,)))
                mbs.append(a.i + t * M)
            out.append(("U", tuple(sorted(set(mbs)))))
        return out
    pending: list[int] = []
    done = 0
    for a in stage_stream(name, s, S, M, k, order):
        if done >= N:
            break
        if a.kind == "U":
            if pending:
                out.append(("U", tuple(pending)))
                pending = []
            continue
        if a.i >= N:
            continue
        out.append((a.kind, (a.i,)))
        if a.kind == "B":
            pending.append(a.i)
            done += 1
    if pending:
        out.append(("U", tuple(pending)))
    return out


@pytest.mark.parametrize("name,order,S,M,k", CASES)
def test_streams_equal_schedule_ir(
    name: str, order: str | None, S: int, M: int, k: int | None
) -> None:
    T = 4 if k is None else 2 * k  # the IR requires k | T*M
    kk = k or (M if name in SYNC_SCHEDULES or name == "2bw" else 1)
    try:
        sched = schedule_ir.generate(name, stages=S, chunks=M, steps=T, update_size=k, order=order)
    except ValueError as exc:
        pytest.skip(f"schedule IR refuses this case: {exc}")
    for s in range(S):
        ir = [(a.kind.value, a.mbs) for a in sched.actions[s] if a.kind.value in ("F", "B", "U")]
        assert runtime_actions(name, order, s, S, M, kk, T) == ir, f"stage {s}"


@pytest.mark.parametrize("name,order,S,M", sorted({c[:4] for c in CASES}, key=str))
def test_delays_match_schedule_analysis(name: str, order: str | None, S: int, M: int) -> None:
    k = M if name in SYNC_SCHEDULES or name == "2bw" else 1
    fv = (lambda s, i, u: max(i // M - 1, 0)) if name == "2bw" else None
    mine, _ = derive_delays(name, S, M, k, order, fv)
    T = max(8, 4 * S)
    report = schedule_ir.analyze(
        schedule_ir.generate(name, stages=S, chunks=M, steps=T, order=order)
    )
    assert tuple(mine) == report.delays
