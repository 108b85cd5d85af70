"""The schedule IR and its text form: actions, parse/format round trips, parse errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.schedule import SCHEDULES, Action, Kind, Schedule, format_schedule, generate, parse
from engine.schedule.text import format_action, parse_action


def _combos() -> list[tuple[str, int, int, int, str | None]]:
    out = []
    for name in SCHEDULES:
        for S in (1, 2, 3, 4, 8):
            for M in sorted({1, S, 2 * S + 1}):
                if name == "2bw" and M < S:
                    continue
                for T in (1, 2):
                    for order in ("dataflow", "1f1b") if name == "pb" else (None,):
                        out.append((name, S, M, T, order))
    return out


COMBOS = _combos()


@pytest.mark.parametrize(
    "token, action",
    [
        ("F3", Action.forward(3)),
        ("B0", Action.backward(0)),
        ("SF12", Action.send_act(12)),
        ("RF1", Action.recv_act(1)),
        ("SB2", Action.send_grad(2)),
        ("RB7", Action.recv_grad(7)),
        ("U5", Action.update([5])),
        ("U0-3", Action.update(range(4))),
        ("U0-1+4", Action.update([0, 1, 4])),
        ("U0+2+4-5", Action.update([0, 2, 4, 5])),
    ],
)
def test_action_tokens_round_trip(token: str, action: Action) -> None:
    assert parse_action(token) == action
    assert format_action(action) == token == str(action)


@given(st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True))
def test_update_token_round_trip_any_set(mbs: list[int]) -> None:
    a = Action.update(mbs)
    assert parse_action(format_action(a)) == a


def test_action_invariants() -> None:
    assert Action.forward(2).mb == 2 and Action.forward(2).kind is Kind.FORWARD
    with pytest.raises(ValueError, match="exactly one micro-batch"):
        Action(Kind.FORWARD, (1, 2))
    with pytest.raises(ValueError, match="distinct and sorted"):
        Action(Kind.UPDATE, (2, 1))
    with pytest.raises(ValueError, match=">= 0"):
        Action.backward(-1)
    with pytest.raises(AttributeError, match="mbs"):
        _ = Action.update([1, 2]).mb
    assert Kind.SEND_ACT.peer_offset == 1 and Kind.RECV_ACT.peer_offset == -1
    assert Kind.SEND_GRAD.peer_offset == -1 and Kind.RECV_GRAD.peer_offset == 1


@pytest.mark.parametrize("name, S, M, T, order", COMBOS)
def test_round_trip_every_generator(name: str, S: int, M: int, T: int, order: str | None) -> None:
    sched = generate(name, stages=S, chunks=M, steps=T, order=order)
    text = format_schedule(sched)
    back = parse(text)
    assert back == sched
    assert format_schedule(back) == text


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(SCHEDULES),
    S=st.integers(1, 6),
    M=st.integers(1, 7),
    T=st.integers(1, 3),
    dataflow=st.booleans(),
)
def test_round_trip_property(name: str, S: int, M: int, T: int, dataflow: bool) -> None:
    if name == "2bw" and M < S:
        M = S
    order = ("dataflow" if dataflow else "1f1b") if name == "pb" else None
    sched = generate(name, stages=S, chunks=M, steps=T, order=order)
    assert parse(format_schedule(sched)) == sched


def test_compact_form_without_ticks_round_trips() -> None:
    text = (
        "schedule custom stages=2 chunks=2 steps=1 update_size=2 order=1f1b weights=live ticks=0\n"
        "s0: F0 F1 B0 B1 U0-1\n"
        "s1: F0 B0 F1 B1 U0-1\n"
    )
    sched = parse(text)
    assert sched.ticks is None and not sched.has_comms
    assert sched.actions[1] == (
        Action.forward(0),
        Action.backward(0),
        Action.forward(1),
        Action.backward(1),
        Action.update([0, 1]),
    )
    assert format_schedule(sched) == text


def test_parse_ignores_comments_and_padding() -> None:
    text = (
        "# a comment\n"
        "schedule pb stages=1 chunks=2 steps=1 update_size=1 order=dataflow weights=live ticks=1\n"
        "\n"
        "s0:   F0 B0 U0   |   F1   B1 U1\n"
    )
    sched = parse(text)
    assert sched.ticks == ((0, 0, 0, 1, 1, 1),)
    assert sched == generate("pb", stages=1, chunks=2)


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "empty schedule text"),
        ("schedul x stages=1\n", "expected the header"),
        ("schedule x stages=1 chunks=1\ns0: F0\n", r"header lacks \['steps'"),
        (
            "schedule x stages=1 chunks=1 steps=1 update_size=1 order=o weights=live ticks=0 colour=red\n",
            "unknown header field",
        ),
        (
            "schedule x stages=2 chunks=1 steps=1 update_size=1 order=o weights=live ticks=0\ns0: F0\n",
            "stages=2 but 1 stage lines",
        ),
        (
            "schedule x stages=1 chunks=1 steps=1 update_size=1 order=o weights=live ticks=0\ns1: F0\n",
            "expected stage line 's0",
        ),
        (
            "schedule x stages=1 chunks=1 steps=1 update_size=1 order=o weights=live ticks=0\ns0: F0 X1\n",
            r"line 2 \(stage 0\): cannot parse action 'X1'",
        ),
        (
            "schedule x stages=1 chunks=1 steps=1 update_size=1 order=o weights=live ticks=0\ns0: U3-1\n",
            "empty range",
        ),
        (
            "schedule x stages=1 chunks=1 steps=1 update_size=1 order=o weights=live ticks=1\ns0: F0 || B0\n",
            "write '.' for an idle tick",
        ),
        (
            "schedule x stages=1 chunks=1 steps=1 update_size=1 order=o weights=fresh ticks=0\ns0: F0\n",
            "unknown weight policy",
        ),
    ],
)
def test_parse_errors_say_what_is_wrong(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse(text)


def test_schedule_shape_checks() -> None:
    with pytest.raises(ValueError, match="one list per stage"):
        Schedule("x", 2, 1, 1, 1, "1f1b", "live", ((Action.forward(0),),))
    with pytest.raises(ValueError, match="one tick per action"):
        Schedule("x", 1, 1, 1, 1, "1f1b", "live", ((Action.forward(0),),), ticks=((0, 1),))


@pytest.mark.parametrize(
    "name, order", [("1f1b", None), ("pb", "dataflow"), ("2bw", None), ("gpipe", None)]
)
def test_compact_view_is_a_valid_equivalent_schedule(name: str, order: str | None) -> None:
    from engine.schedule import analyze, validate

    sched = generate(name, stages=3, chunks=3, steps=2, order=order)
    for comms, ticks in [(False, True), (False, False), (True, False)]:
        text = format_schedule(sched, comms=comms, ticks=ticks)
        compact = parse(text)
        assert format_schedule(compact) == text
        assert compact.has_comms == comms and (compact.ticks is not None) == ticks
        validate(compact)
        a, b = analyze(sched), analyze(compact)
        assert (a.delays, a.versions, a.activation_peak, a.makespan) == (
            b.delays,
            b.versions,
            b.activation_peak,
            b.makespan,
        )


def test_compact_view_text() -> None:
    text = format_schedule(generate("1f1b", stages=2, chunks=2), comms=False, ticks=False)
    assert text.splitlines()[1:] == ["s0: F0 F1 B0 B1 U0-1", "s1: F0 B0 F1 B1 U0-1"]
