"""Timeline PNG and Chrome trace JSON are produced and well formed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.schedule import analyze, chrome_trace, generate, render_timeline


@pytest.mark.parametrize("name, order", [("1f1b", None), ("pb", "dataflow"), ("2bw", None)])
def test_render_timeline_png(tmp_path: Path, name: str, order: str | None) -> None:
    sched = generate(name, stages=3, chunks=4, steps=2, order=order)
    out = render_timeline(sched, tmp_path / "timeline.png")
    data = Path(out).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


@pytest.mark.parametrize("name, kinds", [
    ("pb", ["forward", "backward", "update"]),
    ("zbh1", ["forward", "backward", "weight gradient", "update"]),
])
def test_every_bar_lies_inside_the_axes_and_the_legend_names_what_is_drawn(name: str, kinds: list[str]) -> None:
    """The compare's timeline_pb.png clipped stage 0's last update (a bar centred on the
    makespan ended on the frame), listed "weight gradient", which pb never draws, and lost
    its title's line break."""
    import matplotlib.pyplot as plt

    from engine.schedule.render import timeline_figure

    fig = timeline_figure(generate(name, stages=8, chunks=8, steps=2), title=f"{name}: two steps\nits bubble")
    try:
        ax = fig.axes[0]
        left, right = ax.get_xlim()
        edges = [(p.get_x(), p.get_x() + p.get_width()) for p in ax.patches]
        assert left < min(a for a, _ in edges) and max(b for _, b in edges) < right
        assert [t.get_text() for t in ax.get_legend().get_texts()] == kinds
        assert ax.get_title() == f"{name}: two steps\nits bubble"  # its own line break kept
    finally:
        plt.close(fig)


def test_chrome_trace(tmp_path: Path) -> None:
    sched = generate("pb", stages=3, chunks=3, steps=2)
    trace = chrome_trace(sched)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    loaded = json.loads(path.read_text())
    events = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in events} == {0, 1, 2}
    names = {(e["tid"], e["name"]) for e in events}
    assert (0, "F5") in names and (2, "B0") in names and (1, "U3") in names
    rep = analyze(sched)
    f0 = next(e for e in events if e["tid"] == 1 and e["name"] == "F0")
    assert f0["ts"] == rep.record(1, 0).f_start * 1000 and f0["dur"] == 1000
    assert f0["args"]["delay"] == rep.record(1, 0).delay
    meta = [e for e in loaded["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert [e["args"]["name"] for e in meta] == ["stage 0", "stage 1", "stage 2"]
    assert loaded["otherData"]["delays"] == list(rep.delays)
    # one writer (engine/trace_events.py): the modelled trace is a valid trace-event document
    # in the shape pipe.trace(path) records
    from engine.trace_events import validate

    assert validate(loaded) == []


def test_import_is_light() -> None:
    import subprocess
    import sys

    code = "import sys, engine.schedule; print('matplotlib' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        check=True,
    )
    assert out.stdout.strip() == "False False"


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.schedule.__main__ import main

    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    assert main(["pb", "-S", "3", "-M", "3", "--png", str(png), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("schedule pb stages=3") and "stage 0: delay 2" in out
    assert png.stat().st_size > 0 and json.loads(trace.read_text())["traceEvents"]
    golden = tmp_path / "s.txt"
    golden.write_text(
        "schedule c stages=1 chunks=1 steps=1 update_size=1 order=x weights=live ticks=0\ns0: B0 F0 U0\n"
    )
    assert main(["--file", str(golden)]) == 2
    assert "stage 0, action 0 (B0): backward before its forward F0" in capsys.readouterr().err
    assert main(["2bw", "-S", "4", "-M", "2"]) == 2
