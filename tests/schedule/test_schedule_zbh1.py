"""ZB-H1: the backward split into B (input gradient) and W (weight gradient), as schedule data.

What would break without the feature: the W token, the rules that tie W to its B and to the
update, the split cost model, the activation bound and the bubble (S-1)/(3M+S-1) that the
analysis measures for equal F/B/W costs (against 1f1b's (S-1)/(M+S-1)).
"""

from __future__ import annotations

import pytest

from engine.schedule import Action, Costs, Kind, ScheduleError, analyze, generate, parse, validate
from engine.schedule.text import format_schedule, parse_action

EQUAL = Costs(forward=1, backward=2, weight=1)  # F = B(input) = W = 1


@pytest.mark.parametrize("S, M", [(2, 2), (2, 5), (3, 3), (4, 8), (4, 16), (8, 8)])
def test_bubble_matches_formula(S: int, M: int) -> None:
    """M >= S, F = B = W = 1: makespan 3M + S - 1, bubble (S-1)/(3M+S-1) exactly."""
    rep = analyze(generate("zbh1", stages=S, chunks=M), EQUAL)
    assert rep.makespan == 3 * M + S - 1
    assert rep.bubble_fraction == pytest.approx((S - 1) / (3 * M + S - 1), abs=1e-12)
    # the same work as 1f1b with whole backwards (B = 2): 1f1b's bubble is (S-1)/(M+S-1)
    one = analyze(generate("1f1b", stages=S, chunks=M), Costs(forward=1, backward=2))
    assert one.bubble_fraction == pytest.approx((S - 1) / (M + S - 1), abs=1e-12)
    assert rep.bubble_fraction < one.bubble_fraction
    assert rep.delays == (0,) * S
    assert rep.activation_peak == (min(M, S),) * S  # 1f1b's stage-0 peak, on every stage


def test_stage_order_and_text_round_trip() -> None:
    sched = generate("zbh1", stages=3, chunks=4)
    compact = format_schedule(sched, comms=False, ticks=False).splitlines()[1:]
    # stage s defers its weight gradients by s backwards
    assert compact == [
        "s0: F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3 U0-3",
        "s1: F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3 U0-3",
        "s2: F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3 U0-3",
    ]
    assert parse(format_schedule(sched)) == sched
    assert parse_action("W7") == Action.weight(7) == Action(Kind.WEIGHT, (7,))
    # splitting keeps each stage's total work: with default costs B + W = one whole backward
    busy = analyze(sched).makespan * 3 * (1 - analyze(sched).bubble_fraction)
    assert busy == pytest.approx(3 * 4 * (1 + 2))


@pytest.mark.parametrize(
    "stage0, match",
    [
        ("F0 W0 B0 U0", r"action 1 \(W0\): weight gradient before its input-gradient backward B0"),
        ("F0 B0 U0 W0", r"action 2 \(U0\): .*W0 has not run on this stage yet"),
        ("F0 B0 W0 W0 U0", r"action 3 \(W0\): W0 appears twice"),
    ],
)
def test_validator_rules(stage0: str, match: str) -> None:
    text = f"schedule mine stages=1 chunks=1 steps=1 update_size=1 order=x weights=live ticks=0\ns0: {stage0}\n"
    with pytest.raises(ScheduleError, match=match):
        validate(parse(text))


def test_activation_bound_counts_until_w() -> None:
    ok = "schedule zbh1 stages=1 chunks=2 steps=1 update_size=2 order=zb-h1 weights=live ticks=0\n"
    validate(parse(ok + "s0: F0 B0 W0 F1 B1 W1 U0-1\n"))  # S = 1: bound min(M, S) = 1
    with pytest.raises(ScheduleError, match="holds the activations of 2 micro-batches"):
        validate(parse(ok + "s0: F0 B0 F1 B1 W0 W1 U0-1\n"))  # B0 done, W0 not yet


def test_costs_checked() -> None:
    sched = generate("zbh1", stages=2, chunks=2)
    with pytest.raises(ValueError, match=r"costs.weight \(3.0\) exceeds costs.backward \(2.0\)"):
        analyze(sched, {"W": 3})
    assert analyze(sched, {"F": 1, "B": 2, "W": 1}).makespan == 3 * 2 + 1


@pytest.mark.slow  # importing torch.distributed.pipelining takes ~4 s
@pytest.mark.parametrize("S, M", [(2, 3), (3, 4), (4, 8), (4, 2)])
def test_same_order_as_torch_zero_bubble(S: int, M: int) -> None:
    """torch.distributed.pipelining's zero-bubble rank ops with one stage per rank (I = B)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    rank_ops = schedules._get_1f1b_rank_ops
    sched = generate("zbh1", stages=S, chunks=M)
    for r in range(S):
        warm = min(S - 1 - r, M)
        def stage(_op: int, r: int = r) -> int:  # one stage per rank: every op is on r
            return r

        ops = rank_ops(1, S, warm, M - warm, warm, r, stage, stage,
                       num_1f1b_microbatches=r, enable_zero_bubble=True)
        theirs = [str(o)[len(str(r)):].replace("I", "B") for o in ops if o is not None]
        assert theirs == [str(a) for a in sched.actions[r] if a.kind.is_compute]
