"""The engine's clock: a discrete-event replay whose bubble fractions match the formulas."""

from __future__ import annotations

import pytest

from engine.runtime.exec.clock import Clock

F, B = 0, 1


def _gpipe(clock: Clock, S: int, M: int, first: int, f_sec: float, b_sec: float) -> None:
    for n in range(first, first + M):
        for s in range(S):
            clock.record(s, F, n, f_sec)
    for n in range(first, first + M):
        for s in reversed(range(S)):
            clock.record(s, B, n, b_sec)


@pytest.mark.parametrize("S,M", [(1, 1), (2, 3), (4, 8), (8, 8)])
def test_gpipe_bubble_is_the_formula(S: int, M: int) -> None:
    clock = Clock(S)
    _gpipe(clock, S, M, 0, 1.0, 2.0)  # wall costs equal to the unit costs
    unit, wall = clock.bubble()
    assert unit == pytest.approx((S - 1) / (M + S - 1))
    assert wall == pytest.approx(unit)


def test_a_barrier_starts_the_next_step_after_everything() -> None:
    S = 4
    flushed, overlapped = Clock(S), Clock(S)
    for clock, barrier in ((flushed, True), (overlapped, False)):
        for n in range(2):  # two one-forward "steps" through all stages
            for s in range(S):
                clock.record(s, F, n, 1.0)
            if barrier:
                clock.barrier()
    assert flushed.bubble()[0] == pytest.approx(1 - 2 * S / (S * 2 * S))  # span 2S
    assert overlapped.bubble()[0] == pytest.approx(1 - 2 * S / (S * (S + 1)))  # span S+1


def test_wall_time_follows_the_measured_costs() -> None:
    clock = Clock(2)
    # stage 1 twice as slow: stage 0 idles while it works
    for n in range(4):
        clock.record(0, F, n, 1.0)
        clock.record(1, F, n, 2.0)
    unit, wall = clock.bubble()
    assert unit == pytest.approx(1 - 8 / (2 * 5))  # F = 1 each: span 5, busy 8
    assert wall == pytest.approx(1 - 12 / (2 * 9))  # span 1 + 4 * 2, busy 4 + 8


def test_replay_in_batches_equals_one_replay() -> None:
    a, b = Clock(3), Clock(3)
    for k in range(3):
        _gpipe(a, 3, 5, k * 5, 0.5 + k, 1.5)
        _gpipe(b, 3, 5, k * 5, 0.5 + k, 1.5)
        a.bubble()  # forces a replay now; b replays once at the end
    assert a.bubble() == b.bubble()
