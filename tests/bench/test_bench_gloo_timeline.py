"""bench/gloo_timeline.py's arithmetic on a made-up timeline (no processes): which events form
a step, the hop latencies between stages, and the CPU split per step."""

from __future__ import annotations

import pytest
from bench_support import load_bench


def _timeline(step_len: float = 100.0, steps: int = 3) -> list[list[tuple[str, float, float, float]]]:
    """Two stages, two micro-batches a step (times in seconds, CPU = duration / 2). Within a
    step starting at t: stage 0 F0 [t, t+1], F1 [t+1, t+2]; stage 1 F0 [t+1.5, t+2.5],
    F1 [t+3, t+4], B0 [t+4, t+5], B1 [t+5, t+6], U [t+6, t+7]; stage 0 B0 [t+5.25, t+6],
    B1 [t+6.5, t+7], U [t+7, t+8]."""
    ranks: list[list[tuple[str, float, float, float]]] = [[], []]
    for k in range(steps):
        t = k * step_len
        s0 = [("F", 0, 1), ("F", 1, 2), ("B", 5.25, 6), ("B", 6.5, 7), ("U", 7, 8)]
        s1 = [("F", 1.5, 2.5), ("F", 3, 4), ("B", 4, 5), ("B", 5, 6), ("U", 6, 7)]
        for r, evs in enumerate((s0, s1)):
            ranks[r] += [(kind, t + a, t + b, (b - a) / 2) for kind, a, b in evs]
    return ranks


def test_hops_between_two_stages() -> None:
    tl = load_bench("gloo_timeline")
    got = tl.hops(_timeline(), M=2)
    assert got["act0"] == [pytest.approx(500.0)]  # F0 ends at t+1, starts on s1 at t+1.5
    assert got["act"] == [pytest.approx(1000.0)]  # F1: t+2 -> t+3
    assert got["grad"] == [pytest.approx(250.0)]  # B0 ends on s1 at t+5, starts on s0 at t+5.25
    assert got["grad_last"] == [pytest.approx(500.0)]  # B1: t+6 -> t+6.5


def test_steps_are_cut_at_each_update_and_cpu_is_split_by_kind() -> None:
    tl = load_bench("gloo_timeline")
    rank0 = _timeline()[0]
    steps = tl.by_step(rank0)
    assert len(steps) == 3 and all(s[-1][0] == "U" for s in steps)
    # per step, CPU = half the wall: F 1.0 s (two 1 s forwards), B 0.625 (0.75 + 0.5 s),
    # U 0.5; of 3 s in all
    split = tl.cpu_split(rank0, total=3 * 3.0, steps=3)
    assert split == pytest.approx({"F": 1000.0, "B": 625.0, "U": 500.0, "rest": 875.0})
