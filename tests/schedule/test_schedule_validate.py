"""The validator rejects hand-made bad schedules with a message pointing at the action."""

from __future__ import annotations

import re
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.schedule import ScheduleError, generate, parse, validate


def _sched(
    name: str, S: int, M: int, k: int, *lines: str, T: int = 1, weights: str = "live"
) -> str:
    head = f"schedule {name} stages={S} chunks={M} steps={T} update_size={k} order=1f1b weights={weights} ticks=0\n"
    return head + "".join(f"s{i}: {ln}\n" for i, ln in enumerate(lines))


def _reject(text: str, match: str) -> ScheduleError:
    with pytest.raises(ScheduleError, match=match) as info:
        validate(parse(text))
    return info.value


def test_backward_before_forward() -> None:
    err = _reject(
        _sched("custom", 1, 2, 2, "F0 B1 F1 B0 U0-1"),
        re.escape("stage 0, action 1 (B1): backward before its forward F1"),
    )
    assert (err.stage, err.index, str(err.action)) == (0, 1, "B1")


def test_deadlock_with_communication() -> None:
    err = _reject(
        _sched("custom", 2, 1, 1, "RB0 F0 SF0 B0 U0", "RF0 F0 B0 SB0 U0"),
        r"stage 0, action 0 \(RB0\): deadlock.*stage 0 action 0 \(RB0\) waits for SB0 on stage 1.*"
        r"stage 1 action 0 \(RF0\) waits for SF0 on stage 0",
    )
    assert err.stage == 0 and err.index == 0


def test_deadlock_without_communication() -> None:
    _reject(
        _sched("custom", 2, 2, 2, "F0 B0 F1 B1 U0-1", "F1 F0 B0 B1 U0-1"),
        r"deadlock.*stage 0 action 1 \(B0\) waits for B0 on stage 1.*stage 1 action 0 \(F1\) waits for F1 on stage 0",
    )


def test_unmatched_send() -> None:
    _reject(
        _sched("custom", 2, 1, 1, "F0 SF0 RB0 B0 U0", "F0 B0 SB0 U0"),
        re.escape("stage 0, action 1 (SF0): unmatched send: stage 1 has no matching receive RF0"),
    )


def test_unmatched_receive() -> None:
    _reject(
        _sched("custom", 2, 1, 1, "F0 SF0 B0 U0", "RF0 F0 B0 SB0 U0"),
        re.escape("stage 1, action 3 (SB0): unmatched send: stage 0 has no matching receive RB0"),
    )


def test_sends_and_receives_out_of_order() -> None:
    _reject(
        _sched(
            "custom",
            2,
            2,
            2,
            "F0 F1 SF1 SF0 RB0 B0 RB1 B1 U0-1",
            "RF0 F0 RF1 F1 B0 SB0 B1 SB1 U0-1",
        ),
        r"stage 1, action 0 \(RF0\): receives the activation of micro-batch 0 from stage 0, but send "
        r"number 0 on that channel is stage 0's action 2 \(SF1\)",
    )


def test_gradient_never_applied() -> None:
    _reject(
        _sched("custom", 1, 2, 1, "F0 B0 U0 F1 B1"),
        re.escape("stage 0, action 4 (B1): gradient of micro-batch 1 is never applied"),
    )


def test_gradient_applied_twice() -> None:
    _reject(
        _sched("custom", 1, 2, 1, "F0 B0 U0 F1 B1 U0 U1"),
        re.escape(
            "stage 0, action 5 (U0): gradient of micro-batch 0 is applied twice (first by action 2 (U0))"
        ),
    )


def test_update_before_backward() -> None:
    _reject(
        _sched("custom", 1, 1, 1, "F0 U0 B0"),
        re.escape(
            "stage 0, action 1 (U0): update applies the gradient of micro-batch 0, but its backward B0 has not run"
        ),
    )


def test_update_of_wrong_size() -> None:
    _reject(
        _sched("custom", 1, 2, 2, "F0 B0 U0 F1 B1 U1"),
        "update applies 1 gradients but update_size is 2",
    )


def test_missing_micro_batch() -> None:
    _reject(
        _sched("custom", 1, 2, 1, "F0 B0 U0"),
        re.escape("stage 0: micro-batch 1 never runs its forward (F1)"),
    )


def test_out_of_range_and_missing_peer() -> None:
    _reject(_sched("custom", 1, 1, 1, "F0 B0 U0 F5"), "micro-batch 5 is out of range")
    _reject(
        _sched("custom", 1, 1, 1, "F0 SF0 B0 U0"),
        re.escape("stage 0, action 1 (SF0): its peer would be stage 1, which does not exist"),
    )


def test_forward_without_receive() -> None:
    _reject(
        _sched("custom", 2, 2, 2, "F0 SF0 F1 RB0 B0 RB1 B1 U0-1", "RF0 F0 F1 B0 SB0 B1 SB1 U0-1"),
        re.escape("stage 1, action 2 (F1): forward before receiving its input; put RF1 before it"),
    )


def test_duplicate_forward() -> None:
    _reject(
        _sched("custom", 1, 1, 1, "F0 F0 B0 U0"),
        re.escape("stage 0, action 1 (F0): F0 appears twice on this stage (first at action 0)"),
    )


def test_activation_bound() -> None:
    # gpipe-style order under the name 1f1b: stage 0 holds 3 > S - s = 2 micro-batches
    _reject(
        _sched("1f1b", 2, 3, 3, "F0 F1 F2 B0 B1 B2 U0-2", "F0 B0 F1 B1 F2 B2 U0-2"),
        re.escape(
            "stage 0, action 2 (F2): holds the activations of 3 micro-batches after this forward, above the bound 2"
        ),
    )
    # the same schedule passes under the gpipe name (bound M) or with explicit bounds
    validate(parse(_sched("gpipe", 2, 3, 3, "F0 F1 F2 B0 B1 B2 U0-2", "F0 B0 F1 B1 F2 B2 U0-2")))
    validate(
        parse(_sched("1f1b", 2, 3, 3, "F0 F1 F2 B0 B1 B2 U0-2", "F0 B0 F1 B1 F2 B2 U0-2")),
        activation_bounds=[3, 1],
    )


def test_2bw_needs_produced_versions() -> None:
    bad = replace(generate("pipedream", stages=3, chunks=1, steps=3), name="2bw", weights="2bw")
    with pytest.raises(
        ScheduleError,
        match=r"stage 0, action 4 \(F2\): 2bw forward of micro-batch 2 needs weight version 1 but only 0 updates",
    ):
        validate(bad)


def test_ticks_checked() -> None:
    good = generate("pb", stages=2, chunks=2)
    assert good.ticks is not None
    validate(good)
    ticks = [list(t) for t in good.ticks]
    ticks[1] = [t - 1 for t in ticks[1]]  # stage 1 now receives in the tick stage 0 sends
    with pytest.raises(
        ScheduleError,
        match=r"stage 1, action 0 \(RF0\): placed at tick 0, but it depends on SF0 on stage 0 at tick 0",
    ):
        validate(replace(good, ticks=tuple(map(tuple, ticks))))
    ticks = [list(t) for t in good.ticks]
    ticks[0][1] = 5
    with pytest.raises(ScheduleError, match="ticks must not decrease"):
        validate(replace(good, ticks=tuple(map(tuple, ticks))))


MUTATED = ["gpipe", "1f1b", "pipedream", "2bw", "pb"]


def _check_mutation(name: str, S: int, M: int, s: int, i: int, j: int | None) -> None:
    """Swap actions i and j of stage s (j None: drop action i) and validate: a drop must be
    refused (every action of these families is needed), a swap passes or is explained; the
    validator never crashes."""
    sched = generate(name, stages=S, chunks=max(M, S) if name == "2bw" else M, steps=2)
    acts = list(sched.actions[s])
    if j is not None:
        acts[i], acts[j] = acts[j], acts[i]
        ticks = sched.ticks
    else:
        del acts[i]
        ticks = None
    actions = tuple(tuple(acts) if t == s else a for t, a in enumerate(sched.actions))
    try:
        validate(replace(sched, actions=actions, ticks=ticks))
    except ScheduleError as e:
        assert e.stage is not None and str(e).startswith(f"stage {e.stage}")
        return
    assert j is not None, f"{name} S={S} M={M}: dropping stage {s}'s action {i} was accepted"


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(MUTATED),
    S=st.integers(1, 4),
    M=st.integers(1, 5),
    data=st.data(),
)
def test_mutated_schedules_fail_only_with_schedule_errors(
    name: str, S: int, M: int, data: st.DataObject
) -> None:
    """Swapping or dropping actions never crashes the validator: it passes or explains, and
    a dropped action is always refused."""
    sched = generate(name, stages=S, chunks=max(M, S) if name == "2bw" else M, steps=2)
    s = data.draw(st.integers(0, S - 1))
    n = len(sched.actions[s])
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(0, n - 1)) if data.draw(st.booleans()) else None
    _check_mutation(name, S, M, s, i, j)


def test_mutation_check_fails_for_a_validator_that_accepts_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "validate", lambda *a, **k: None)
    with pytest.raises(AssertionError, match="was accepted"):
        _check_mutation("1f1b", 2, 2, 0, 0, None)
    _check_mutation("1f1b", 2, 2, 0, 0, 1)  # a swap may pass
