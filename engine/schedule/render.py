"""Pictures of a schedule: a timeline PNG and a Chrome/Perfetto trace.

Why both: the PNG goes into docs, bug reports and bench results; the trace JSON opens in
chrome://tracing or ui.perfetto.dev where one can zoom into a long asynchronous run and
compare it with a trace the runtime records (same layout: one process, one thread per
stage, ``ph: "X"`` complete events named like the text form, ``F3``, ``B3``, ``U0-3``).

Times come from :func:`engine.schedule.analyze`'s cost-model clock (F = 1, B = 2 by default),
so the pictures show the same bubbles the analysis counts. Sends and receives are free in
the default cost model and are not drawn. With virtual stages (interleaved 1F1B) the PNG has
one row per rank and a box reads ``stage:micro-batch``; the trace keeps one thread per
virtual stage.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from engine import trace_events
from engine.schedule.analysis import analyze
from engine.schedule.ir import Kind, Schedule
from engine.schedule.simulate import Costs

_COLOURS = {
    Kind.FORWARD: "#4C72B0",
    Kind.BACKWARD: "#55A868",
    Kind.WEIGHT: "#8172B2",
    Kind.UPDATE: "#C44E52",
}
_CATEGORY = {
    Kind.FORWARD: "forward",
    Kind.BACKWARD: "backward",
    Kind.WEIGHT: "weight gradient",
    Kind.UPDATE: "update",
}


def describe(schedule: Schedule, bubble: float | None = None) -> str:
    """One line naming a schedule's shape in words, e.g. ``zbv: 4 stages on 2 ranks (V
    placement), 8 micro-batches per mini-batch, 1 mini-batch, update every 8; bubble 0.04``."""
    s = schedule
    name = s.name if s.order in (s.name, "") else f"{s.name} (order {s.order})"
    where = f"{s.stages} stages"
    if s.rank_order is not None:
        shape = "V placement" if s.placement is not None and _is_v(s) else (
            "placement " + ",".join("+".join(map(str, r)) for r in s.placement)
            if s.placement is not None else "round-robin"
        )
        where += f" on {s.ranks} ranks ({shape})"
    steps = f"{s.steps} mini-batch" + ("es" if s.steps != 1 else "")
    text = (
        f"{name}: {where}, {s.chunks} micro-batches per mini-batch, {steps}, "
        f"update every {s.update_size}"
    )
    return text if bubble is None else f"{text}; bubble {bubble:.3f}"


def _is_v(s: Schedule) -> bool:
    R = s.ranks
    return s.placement == tuple((r, 2 * R - 1 - r) for r in range(R))


def render_timeline(
    schedule: Schedule,
    path: str | os.PathLike[str],
    costs: Costs | Mapping[str, object] | None = None,
    *,
    title: str | None = None,
) -> str:
    """Draw stages (ranks) as rows, F/B/W/U as coloured boxes labelled by micro-batch; save a PNG.

    Zero-cost updates are drawn as thin red bars. Returns the path written.
    """
    import matplotlib.pyplot as plt

    fig = timeline_figure(schedule, costs, title=title)
    out = os.fspath(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def timeline_figure(
    schedule: Schedule,
    costs: Costs | Mapping[str, object] | None = None,
    *,
    title: str | None = None,
) -> Any:
    """The matplotlib figure :func:`render_timeline` saves; its x extent covers every box
    with a small margin (a zero-cost update at the very end is drawn centred on the makespan),
    and its legend names the kinds of action it draws."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    report = analyze(schedule, costs)
    tl = report.timeline
    makespan = max(report.makespan, 1e-9)
    S = schedule.ranks  # rows: one per rank (= stage without virtual stages)
    virtual = schedule.rank_order is not None
    # boxes labelled stage:micro-batch (ranks of several stages) need more room per unit
    width = min(max(6.0, makespan * (0.4 if virtual else 0.25)), 60.0)
    fig, ax = plt.subplots(figsize=(width, 0.6 * S + 1.4))
    thin = makespan / 400.0
    drawn: set[Kind] = set()
    for s in range(schedule.stages):
        y = S - 1 - schedule.rank_of(s)
        for i, a in enumerate(schedule.actions[s]):
            if a.kind not in _COLOURS:
                continue
            drawn.add(a.kind)
            t0, t1 = tl.start[s][i], tl.end[s][i]
            dur = t1 - t0
            if a.kind is Kind.UPDATE and dur == 0:
                ax.add_patch(
                    plt.Rectangle((t0 - thin, y - 0.45), 2 * thin, 0.9, color=_COLOURS[a.kind])
                )
                continue
            ax.add_patch(
                plt.Rectangle(
                    (t0, y - 0.4), dur, 0.8, facecolor=_COLOURS[a.kind], edgecolor="black", lw=0.4
                )
            )
            label = "U" if a.kind is Kind.UPDATE else str(a.mb)
            if virtual and a.kind is not Kind.UPDATE:
                label = f"{s}:{a.mb}"
            ax.text(t0 + dur / 2, y, label, ha="center", va="center", fontsize=7, color="white")
    right = max([makespan] + [p.get_x() + p.get_width() for p in ax.patches])
    left = min([0.0] + [p.get_x() for p in ax.patches])
    # a margin of a few bar widths: a bar ending on the limit hides under the axes' frame
    margin = 4 * thin
    ax.set_xlim(left - margin, right + margin)
    ax.set_ylim(-0.6, S - 0.4)
    ax.set_yticks(range(S))
    ax.set_yticklabels([f"{'rank' if virtual else 'stage'} {S - 1 - y}" for y in range(S)])
    ax.set_xlabel("time (cost units)")
    import textwrap

    text = title or describe(schedule, report.bubble_fraction)
    lines = [w for line in text.split("\n")  # the title's own line breaks stay
             for w in textwrap.wrap(line, int(width * 13), break_on_hyphens=False)]
    ax.set_title("\n".join(lines), fontsize=9)
    ax.legend(  # only what the figure draws (no "weight gradient" without a split backward)
        handles=[Patch(color=c, label=_CATEGORY[k]) for k, c in _COLOURS.items() if k in drawn],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    return fig


def chrome_trace(
    schedule: Schedule,
    costs: Costs | Mapping[str, object] | None = None,
    *,
    time_unit_us: float = 1000.0,
) -> dict[str, Any]:
    """A ``{"traceEvents": [...]}`` dict (json.dump it) with one thread per stage.

    One cost unit becomes ``time_unit_us`` microseconds (default 1 ms). F and B events carry
    the micro-batch's t_F, t_B, weight versions and delay in ``args``.
    """
    report = analyze(schedule, costs)
    tl = report.timeline
    meta = trace_events.metadata
    events = [meta("process_name", 0, name=schedule.name)]
    for s in range(schedule.stages):
        events += [meta("thread_name", 0, s, name=f"stage {s}"),
                   meta("thread_sort_index", 0, s, sort_index=s)]
        for i, a in enumerate(schedule.actions[s]):
            if a.kind not in _CATEGORY:
                continue
            args: dict[str, Any] = {"stage": s, "index": i}
            if a.kind is Kind.UPDATE:
                args["micro_batches"] = list(a.mbs)
            else:
                r = report.records[s][a.mb]
                args.update(
                    mb=a.mb,
                    t_F=r.t_F,
                    t_B=r.t_B,
                    version_F=r.version_F,
                    version_B=r.version_B,
                    update=r.update,
                    delay=r.delay,
                )
            events.append(trace_events.complete(
                str(a), _CATEGORY[a.kind], tl.start[s][i] * time_unit_us,
                (tl.end[s][i] - tl.start[s][i]) * time_unit_us, 0, s, args))
    return trace_events.document(events, {
        "schedule": schedule.name, "order": schedule.order, "stages": schedule.stages,
        "chunks": schedule.chunks, "steps": schedule.steps, "update_size": schedule.update_size,
        "bubble_fraction": report.bubble_fraction, "delays": list(report.delays),
    })
