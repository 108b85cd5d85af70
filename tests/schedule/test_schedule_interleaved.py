"""Interleaved 1F1B as schedule data: generator, per-rank order, validator, analysis, text."""

from __future__ import annotations

import itertools
import os
from dataclasses import replace
from pathlib import Path

import pytest

from engine.schedule import (
    Costs,
    Kind,
    ScheduleError,
    analyze,
    format_schedule,
    interleaved,
    parse,
    render_timeline,
    validate,
)
from engine.schedule.interleaved import rank_compute_order

# a folder of its own: test_schedule_golden checks that its folder holds only its cases
GOLDEN_DIR = Path(__file__).parent / "golden" / "schedules" / "interleaved"
REGEN = os.environ.get("ENGINE_REGEN_GOLDEN") == "1"


@pytest.mark.parametrize("case", [(2, 2, 4, 2), (4, 2, 8, 1)], ids=str)
def test_golden_and_round_trip(case: tuple[int, int, int, int]) -> None:
    R, v, M, T = case
    sched = interleaved(R, v, M, steps=T)
    text = format_schedule(sched)
    path = GOLDEN_DIR / f"interleaved-R{R}-v{v}-M{M}-T{T}.txt"
    if REGEN:
        path.write_text(text)
    assert text == path.read_text()
    assert parse(text) == sched
    compact = parse(format_schedule(sched, comms=False, ticks=False))
    validate(compact)  # the compact view still validates rank by rank
    assert compact.rank_order is not None and len(compact.rank_order) == R


def test_layout_and_megatron_order() -> None:
    s = interleaved(2, 2, 4)
    assert (s.stages, s.ranks, s.virtual_stages, s.update_size) == (4, 2, 2, 4)
    assert [s.rank_of(vs) for vs in range(4)] == [0, 1, 0, 1]
    # rank 0 warms up with (v-1)*M/rounds + 2(R-1) = 4 forwards: chunk 0 twice, chunk 1 twice
    assert rank_compute_order(2, 2, 4, 0)[:6] == [
        (0, Kind.FORWARD, 0), (0, Kind.FORWARD, 1), (2, Kind.FORWARD, 0), (2, Kind.FORWARD, 1),
        (0, Kind.FORWARD, 2), (2, Kind.BACKWARD, 0),
    ]
    for r in range(2):  # every virtual stage of the rank runs F and B of every micro-batch
        ops = rank_compute_order(2, 2, 4, r)
        assert sorted(ops) == sorted(
            (vs, k, n) for vs in (r, r + 2) for k in (Kind.FORWARD, Kind.BACKWARD) for n in range(4)
        )


def test_bubble_formula() -> None:
    """Megatron's bubble ratio (idle / busy per rank) is (R-1)/(v*M) for equal costs when
    M >= R; with M < R the rounds are short and the ratio is larger."""
    for R, v, M in itertools.product((2, 3, 4), (2, 3), (1, 2, 3, 4, 6, 8)):
        if M >= R and M % max(1, M // R):
            continue
        s = interleaved(R, v, M)
        for costs in (Costs(), Costs(forward=1.0, backward=1.0)):
            rep = analyze(s, costs)
            want = (R - 1) / (v * M)
            for got in rep.rank_bubble:
                if M >= R:
                    assert got == pytest.approx(want, abs=1e-12), (R, v, M, costs)
                else:
                    assert got > want
            # the fraction of the makespan idle is then (R-1)/(v*M+R-1)
            if M >= R:
                assert rep.bubble_fraction == pytest.approx((R - 1) / (v * M + R - 1))
            assert rep.delays == (0,) * (R * v)


def test_interleaving_beats_1f1b_bubble() -> None:
    from engine.schedule import generate

    one = analyze(generate("1f1b", 4, 8)).bubble_fraction
    two = analyze(interleaved(4, 2, 8)).bubble_fraction
    assert two < one
    assert one == pytest.approx(3 / 11) and two == pytest.approx(3 / 19)


def test_validator_catches_a_deadlocking_rank_order() -> None:
    s = interleaved(2, 2, 2)
    # rank 0 runs all of virtual stage 2 first: its first receive waits for stage 1, which
    # waits for stage 0's forward that rank 0 never reaches
    order0 = sorted(s.rank_order[0], key=lambda vs: vs != 2)
    bad = replace(s, rank_order=(tuple(order0), s.rank_order[1]), ticks=None)
    with pytest.raises(ScheduleError, match="deadlock.*rank 0 \\(stage 2\\)"):
        validate(bad)


def test_bad_rank_order_is_refused() -> None:
    s = interleaved(2, 2, 2)
    with pytest.raises(ValueError, match="names virtual stage 0 .* times"):
        replace(s, rank_order=(s.rank_order[0][:-1], s.rank_order[1]))
    with pytest.raises(ValueError, match="run on other ranks"):
        replace(s, rank_order=(s.rank_order[0] + (1,), s.rank_order[1]))
    with pytest.raises(ValueError, match="needs a rank_order"):
        replace(s, rank_order=None)
    with pytest.raises(ValueError, match="virtual_stages must be >= 2"):
        interleaved(2, 1, 4)
    with pytest.raises(ValueError, match="multiple of max"):
        interleaved(2, 2, 5)
    with pytest.raises(ValueError, match="rank-order lines need virtual"):
        parse(format_schedule(s).replace(" virtual=2", ""))


def test_render_rows_are_ranks(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = render_timeline(interleaved(2, 2, 2), tmp_path / "i.png")
    assert Path(out).stat().st_size > 0


def test_cli_prints_the_interleaved_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.__main__ import main

    assert main(["schedule", "interleaved", "-S", "4", "-v", "2", "-M", "8", "--compact"]) == 0
    out = capsys.readouterr().out
    assert "virtual=2" in out and "r3:" in out
    assert "rank 0 (stages [0, 4]): bubble ratio idle/busy 0.1875" in out  # (4-1)/(2*8)
    for argv, needle in (
        (["schedule", "1f1b", "-v", "2"], "--virtual-stages is only for interleaved"),
        (["schedule", "interleaved", "-S", "2", "-M", "5"], "multiple of max(1, M // R)"),
        (["schedule", "interleaved", "-k", "2"], "neither --update-size nor --order"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


@pytest.mark.slow  # importing torch.distributed.pipelining takes ~4 s
def test_same_order_as_torch_interleaved_1f1b() -> None:
    """Every rank's compute order equals torch.distributed.pipelining's ScheduleInterleaved1F1B
    (its per-rank op lists, idle slots dropped), including M < R and M not a multiple of R."""
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    calc = schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations
    fwd = schedules._ComputationType.FORWARD
    for R, v, M in itertools.product((1, 2, 3, 4), (2, 3), (1, 2, 3, 4, 6, 8)):
        rounds = max(1, M // R)
        if M % rounds:
            continue
        ns = SimpleNamespace(
            n_local_stages=v, pp_group_size=R, _n_microbatches=M, microbatches_per_round=M // rounds
        )
        for r in range(R):
            theirs = [
                (o.stage_index, Kind.FORWARD if o.computation_type == fwd else Kind.BACKWARD,
                 o.microbatch_index)
                for o in calc(ns, r) if o is not None
            ]
            assert rank_compute_order(R, v, M, r) == theirs, (R, v, M, r)
