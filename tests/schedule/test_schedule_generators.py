"""Generators: every schedule validates for S in {1,2,3,4,8}, M in {1, S, 2S+1}; bad arguments teach the fix."""

from __future__ import annotations

import pytest
from schedules import SYNC

from engine.schedule import SCHEDULES, Action, Kind, generate, validate


def _combos() -> list[tuple[str, int, int, int, str | None]]:
    """S in {1,2,3,4,8}, M in {1, S, 2S+1}, T in {1,2}, every order; 2bw only where M >= S."""
    return [
        (name, S, M, T, order)
        for name in SCHEDULES
        for S in (1, 2, 3, 4, 8)
        for M in sorted({1, S, 2 * S + 1})
        if not (name == "2bw" and M < S)
        for T in (1, 2)
        for order in (("dataflow", "1f1b") if name == "pb" else (None,))
    ]


COMBOS = _combos()


@pytest.mark.parametrize("name, S, M, T, order", COMBOS)
def test_every_generated_schedule_validates(
    name: str, S: int, M: int, T: int, order: str | None
) -> None:
    sched = generate(name, stages=S, chunks=M, steps=T, order=order)
    validate(sched)
    assert sched.num_micro_batches == M * T
    default = {"naive": "naive", "gpipe": "fill-drain", "zbh1": "zb-h1"}.get(name, "1f1b")
    assert sched.order == (order or default)


@pytest.mark.parametrize("k", [1, 2, 3, 6])
@pytest.mark.parametrize("name, order", [("pb", "dataflow"), ("pb", "1f1b"), ("pipedream", None)])
def test_update_size_k(name: str, order: str | None, k: int) -> None:
    sched = generate(name, stages=3, chunks=3, steps=2, update_size=k, order=order)
    validate(sched)
    for acts in sched.actions:
        ups = [a for a in acts if a.kind is Kind.UPDATE]
        assert [a.mbs for a in ups] == [tuple(range(i, i + k)) for i in range(0, 6, k)]


def test_pb_dataflow_ticks_follow_the_formula() -> None:
    S, N = 4, 9
    sched = generate("pb", stages=S, chunks=N)
    assert sched.ticks is not None
    for s in range(S):
        for a, t in zip(sched.actions[s], sched.ticks[s], strict=True):
            if a.kind is Kind.FORWARD:
                assert t == a.mb + s
            elif a.kind is Kind.BACKWARD:
                assert t == a.mb + 2 * (S - 1) - s


def test_pb_dataflow_within_tick_order() -> None:
    sched = generate("pb", stages=3, chunks=3)
    assert sched.ticks is not None
    stage1_tick3 = [a for a, t in zip(sched.actions[1], sched.ticks[1], strict=True) if t == 3]
    assert [str(a) for a in stage1_tick3] == ["RF2", "F2", "SF2", "RB0", "B0", "SB0", "U0"]


def test_sync_schedules_flush_every_mini_batch() -> None:
    for name in SYNC:
        sched = generate(name, stages=3, chunks=4, steps=3)
        for acts in sched.actions:
            # nothing of mini-batch j+1 runs before mini-batch j's update
            seen_update = -1
            for a in acts:
                if a.kind is Kind.UPDATE:
                    seen_update = a.mbs[-1] // 4
                elif a.kind is Kind.FORWARD:
                    assert a.mb // 4 <= seen_update + 1


def test_async_schedules_never_flush_between_mini_batches() -> None:
    sched = generate("pipedream", stages=3, chunks=2, steps=3)
    stage0 = sched.actions[0]
    # F4 (mini-batch 2) runs before B3 (mini-batch 1): no drain in between
    assert stage0.index(Action.forward(4)) < stage0.index(Action.backward(3))


def test_one_f_one_b_warm_up() -> None:
    sched = generate("1f1b", stages=4, chunks=8)
    for s in range(4):
        computes = [a for a in sched.actions[s] if a.kind.is_compute]
        warm = 3 - s
        assert [a.kind for a in computes[: warm + 1]] == [Kind.FORWARD] * (warm + 1)
        assert computes[warm + 1] == Action.backward(0)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (
            dict(name="2bw", stages=4, chunks=3),
            ValueError,
            r"2bw needs chunks >= stages \(M >= S\), got M=3 < S=4.*chunks >= 4.*pipedream",
        ),
        (dict(name="gpipe", stages=0, chunks=3), ValueError, "stages must be >= 1, got 0"),
        (dict(name="gpipe", stages=2, chunks=0), ValueError, "chunks must be >= 1, got 0"),
        (dict(name="gpipe", stages=2, chunks=2, steps=0), ValueError, "steps must be >= 1"),
        (dict(name="gpipe", stages=2.0, chunks=2), TypeError, "stages must be an int"),
        (dict(name="gpipe", stages=True, chunks=2), TypeError, "stages must be an int"),
        (
            dict(name="zb-h1", stages=2, chunks=2),
            ValueError,
            "unknown schedule 'zb-h1'; known schedules: naive, gpipe, 1f1b, zbh1, interleaved, "
            "looped_bfs, zbv, vhalf, vmin, dualpipev, pipedream, 2bw, pb; did you mean 'zbh1'",
        ),
        (
            dict(name="gpipe", stages=2, chunks=2, order="dataflow"),
            ValueError,
            "runs in order 'fill-drain'",
        ),
        (dict(name="pb", stages=2, chunks=2, order="zigzag"), ValueError, "'dataflow' or '1f1b'"),
        (
            dict(name="1f1b", stages=2, chunks=4, update_size=2),
            ValueError,
            "update_size must equal chunks",
        ),
        (
            dict(name="pb", stages=2, chunks=3, update_size=2),
            ValueError,
            r"k=2 must divide.*= 3.*\[1, 3\]",
        ),
        (
            dict(name="pb", stages=2, chunks=3, update_size=0),
            ValueError,
            "update_size must be >= 1",
        ),
    ],
)
def test_generator_errors(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        generate(**kwargs)


def test_names() -> None:
    assert SCHEDULES == ("naive", "gpipe", "1f1b", "zbh1", "pipedream", "2bw", "pb")
    assert generate("2bw", stages=3, chunks=3).weights == "2bw"
    assert generate("pipedream", stages=3, chunks=3).weights == "stash"
    assert generate("pb", stages=3, chunks=3).weights == "live"
