"""ZB-V, DualPipeV and looped BFS as schedule data: golden files, the V placement, the text
form's placement and overlapped pairs, bubble and per-rank memory, refusals; the
``python -m engine schedule`` command for them and for CSV files (wrapped lines, PNG extent,
a title in words)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from engine.schedule import (
    Action,
    ScheduleError,
    analyze,
    dualpipev,
    format_schedule,
    generate,
    looped_bfs,
    parse,
    to_csv,
    validate,
    vhalf,
    vmin,
    zbv,
)
from engine.schedule.render import describe, timeline_figure
from engine.schedule.text import strip

# a folder of its own: test_schedule_golden checks that its folder holds only its cases
GOLDEN_DIR = Path(__file__).parent / "golden" / "schedules" / "vshape"
REGEN = os.environ.get("ENGINE_REGEN_GOLDEN") == "1"
CASES = {
    "zbv-R2-M4": lambda: zbv(2, 4), "zbv-R4-M8": lambda: zbv(4, 8),
    "dualpipev-R2-M4": lambda: dualpipev(2, 4), "dualpipev-R4-M8": lambda: dualpipev(4, 8),
    "looped_bfs-R2-v2-M4": lambda: looped_bfs(2, 2, 4),
    "vmin-R2-M4": lambda: vmin(2, 4), "vmin-R4-M8": lambda: vmin(4, 8),
    "vhalf-R2-M4": lambda: vhalf(2, 4), "vhalf-R4-M8": lambda: vhalf(4, 8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_golden_and_round_trip(case: str) -> None:
    sched = CASES[case]()
    text = format_schedule(sched)
    path = GOLDEN_DIR / f"{case}.txt"
    if REGEN:
        path.write_text(text)
    assert text == path.read_text(), f"{path.name} changed; regenerate with ENGINE_REGEN_GOLDEN=1"
    assert parse(text) == sched
    compact = parse(format_schedule(sched, comms=False, ticks=False))
    validate(compact)  # the compact view (implied communication) validates rank by rank
    assert compact.placement == sched.placement and compact.overlaps == sched.overlaps


def test_v_placement_and_pairs() -> None:
    s = dualpipev(3, 6)
    assert s.placement == ((0, 5), (1, 4), (2, 3))
    assert [s.rank_of(st) for st in range(6)] == [0, 1, 2, 2, 1, 0]
    assert s.rank_stages(1) == (1, 4)
    for sa, a, sb, b in s.overlaps:  # a forward of one chunk with a backward of the other
        assert s.rank_of(sa) == s.rank_of(sb) and sa != sb
        assert a.kind.value == "F" and b.kind.value == "B"
    # DualPipeV splits some backwards only: a W exists for some B of a stage, not all
    assert any(0 < len(s.split_mbs(st)) < s.chunks for st in range(6))
    assert looped_bfs(2, 2, 4).placement is None  # round-robin is the default


def test_bubble_and_memory() -> None:
    """ZB-V: near-zero bubble at 1F1B's activation memory (in half-size stages: 2R micro-batches
    per rank where 1F1B's first stage holds R full ones); DualPipeV and looped BFS below/above."""
    for R, M in ((2, 8), (4, 8), (4, 16)):
        rep = analyze(zbv(R, M))
        flat = analyze(generate("1f1b", R, M))
        assert rep.bubble_fraction < flat.bubble_fraction / 3
        assert max(rep.rank_activation_peak) == 2 * max(flat.activation_peak)
    assert analyze(zbv(4, 8), {"F": 1, "B": 2, "W": 1}).bubble_fraction < 0.07
    assert max(analyze(looped_bfs(2, 2, 4)).rank_activation_peak) == 8  # every micro-batch, twice
    assert analyze(dualpipev(4, 16)).bubble_fraction < analyze(generate("1f1b", 4, 16)).bubble_fraction


def test_memory_bound_is_checked_and_met() -> None:
    from engine.schedule.validate import activation_bound

    for make in (lambda: zbv(3, 7), lambda: dualpipev(3, 7), lambda: looped_bfs(2, 3, 4)):
        s = make()
        rep = analyze(s)
        bounds = [activation_bound(s, st) for st in range(s.stages)]
        assert list(rep.activation_peak) == bounds  # the bound is tight
    # one more forward in flight on stage 3 of zbv R=2 (bound min(M, S-s) = 1) is refused
    s = strip(zbv(2, 4))  # compute only: the communication is implied
    acts = list(s.actions[3])
    acts.insert(acts.index(Action.backward(0)), acts.pop(acts.index(Action.forward(1))))
    bad = replace(s, actions=(*s.actions[:3], tuple(acts)))
    with pytest.raises(ScheduleError, match=r"stage 3, action 1 \(F1\): holds .* above the bound 1"):
        validate(bad)


def test_refusals() -> None:
    with pytest.raises(ValueError, match=r"dualpipev needs at least as many micro-batches as stages"):
        dualpipev(3, 5)
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        looped_bfs(2, 1, 4)
    s = zbv(2, 4)
    with pytest.raises(ValueError, match="exactly one rank"):
        replace(s, placement=((0, 3), (1, 3)))
    with pytest.raises(ValueError, match="adjacent in one rank's order"):
        replace(s, overlaps=((0, Action.forward(0), 3, Action.backward(3)),))
    with pytest.raises(ValueError, match="bad placement"):
        parse(format_schedule(s).replace("placement=0+3,1+2", "placement=0+x"))
    bad = format_schedule(dualpipev(2, 4)).replace("pairs: 0:F3/3:B1", "pairs: 0:F3-3:B1")
    with pytest.raises(ValueError, match="bad overlapped pair"):
        parse(bad)


def test_png_extent_covers_every_action_and_title_in_words() -> None:
    """The last update (zero cost, drawn centred on its time) used to be half outside."""
    for sched in (generate("1f1b", 4, 8), zbv(2, 4), dualpipev(2, 4)):
        fig = timeline_figure(sched)
        ax = fig.axes[0]
        lo, hi = ax.get_xlim()
        for p in ax.patches:
            assert lo <= p.get_x() and p.get_x() + p.get_width() <= hi
        title = ax.get_title().replace("\n", " ")
        assert title.startswith(describe(sched)) and "(1f1b)" not in title
        assert "T=" not in title and "k=" not in title
    assert describe(zbv(2, 4)) == (
        "zbv: 4 stages on 2 ranks (V placement), 4 micro-batches per mini-batch, 1 mini-batch, "
        "update every 4"
    )


def test_cli_lines_fit_and_files_are_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.__main__ import main

    assert main(["schedule", "1f1b", "-S", "4", "-M", "8"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100 and "# ticks 0-" in out
    assert main(["schedule", "1f1b", "--width", "0"]) == 0
    assert parse(capsys.readouterr().out.split("1f1b (order")[0]) == generate("1f1b", 4, 8)

    csv, png = tmp_path / "zbv.csv", tmp_path / "zbv.png"
    assert main(["schedule", "zbv", "-S", "2", "-M", "4", "--csv", str(csv)]) == 0
    capsys.readouterr()
    assert csv.read_bytes().decode() == to_csv(zbv(2, 4))
    assert main(["schedule", str(csv), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "placement=0+3,1+2" in out and "rank 1 (stages [1, 2])" in out and png.stat().st_size > 0
    text = tmp_path / "prog.txt"
    text.write_text(format_schedule(dualpipev(2, 4)))
    assert main(["schedule", str(text), "--compact"]) == 0
    assert "pairs: 0:F3/3:B1" in capsys.readouterr().out

    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0UNSHARD\n")
    for argv, needle in (
        (["schedule", str(bad)], "column 2 ('0UNSHARD')"),
        (["schedule", str(tmp_path / "none.csv")], "no schedule file"),
        (["schedule", "zbv", "-v", "3"], "--virtual-stages is only for interleaved and looped_bfs"),
        (["schedule", "dualpipev", "-S", "4", "-M", "4"], "at least as many micro-batches"),
        (["schedule", "pb", "--csv", str(tmp_path / "pb.csv")], "synchronous"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err
    with pytest.raises(ScheduleError):
        validate(replace(zbv(2, 4), ticks=None, rank_order=(zbv(2, 4).rank_order[0][::-1],
                                                             zbv(2, 4).rank_order[1])))
