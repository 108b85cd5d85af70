"""The figures of ``python -m engine compare``: training curves, accuracy against depth, and
schedule timelines.

Why apart from compare.py: plotting is matplotlib (an optional extra) and changes for
readability reasons, the comparison for measurement reasons. The curves are small multiples
by method family, so twelve methods never share one panel and identical runs (gpipe, 1f1b)
stay visible; the timelines say what they draw and their bubble.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.cli.loop import TrainResult
from engine.schedule.catalog import family

__all__ = ["plot_curves", "plot_depth", "plot_final", "render_timelines"]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: panels of the curves figure: methods grouped by how their forwards read weights, the
#: live-weight methods split by mitigation family so no panel holds more than five lines
_PANELS = (
    "synchronous (no staleness)",
    "weight stashing",
    "live weights: pb, SC, LWP, SpecTrain",
    "live weights: PipeMare T1 / T2",
)
#: the colour of each panel's methods in the final-metrics figure
_PANEL_COLOURS = ("0.35", "tab:blue", "tab:orange", "tab:green")
_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")


def _panel_of(name: str, schedule: str) -> int:
    fam = family(schedule)  # the catalog says how a family reads weights
    if fam.synchronous:
        return 0
    if not fam.live_async:
        return 1
    return 3 if name.startswith("pipemare") else 2


def plot_curves(results: list[tuple[str, TrainResult]], path: Path, title: str) -> None:
    """Small multiples: one column per method family (synchronous, stashing, and the live
    weights split into SC/LWP/SpecTrain and PipeMare),
    test accuracy on top and training loss below; inside a panel every method has its own
    colour, line style and marker, and the first synchronous method is drawn in grey in every
    other panel as the reference (gpipe and 1f1b compute the same thing, so one of them
    would otherwise hide the other: the second is drawn dashed with markers)."""
    plt = _plt()
    groups: list[list[tuple[str, TrainResult]]] = [[] for _ in _PANELS]
    for name, res in results:
        if res.rows:
            groups[_panel_of(name, res.config.schedule)].append((name, res))
    cols = [k for k, g in enumerate(groups) if g] or [0]
    fig, axes = plt.subplots(2, len(cols), figsize=(4.6 * len(cols), 7.2), squeeze=False,
                             sharey="row")
    reference = groups[0][0] if groups[0] else None
    cmap = plt.get_cmap("tab10")
    for c, k in enumerate(cols):
        top, bottom = axes[0][c], axes[1][c]
        if reference is not None and k != 0:
            name, res = reference
            xs = [r["samples"] for r in res.rows]
            top.plot(xs, [r["test_acc"] for r in res.rows], color="0.6", lw=2.2, label=f"{name} (reference)")
            bottom.plot(xs, [r["train_loss"] for r in res.rows], color="0.6", lw=2.2, label=f"{name} (reference)")
        for i, (name, res) in enumerate(groups[k]):
            xs = [r["samples"] for r in res.rows]
            style = dict(color=cmap(i % 10), ls=_STYLES[i % len(_STYLES)], marker=_MARKERS[i % len(_MARKERS)],
                         markevery=max(1, len(xs) // 6), ms=4, lw=1.5, label=name)
            top.plot(xs, [r["test_acc"] for r in res.rows], **style)
            bottom.plot(xs, [r["train_loss"] for r in res.rows], **style)
        top.set_title(_PANELS[k], fontsize=10)
        top.set_ylabel("test accuracy")
        bottom.set_ylabel("training loss (mean since previous point)")
        bottom.set_yscale("log")
        for ax in (top, bottom):
            ax.set_xlabel("training samples")
            ax.grid(alpha=0.3)
        top.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_final(rows: list[dict[str, Any]], path: Path, title: str) -> str:
    """Which method is best, at a glance: per method (one row each, best training loss on
    top) its final test accuracy and its last-epoch training loss, a dot per seed, the bar
    spanning the seeds' range (mean marked) -- or, for a single seed, the range over the last
    epoch's evaluation points (test accuracy) and metric rows (training loss), which is how
    much the number moves within one run. Returns the caption saying which spread is drawn."""
    plt = _plt()
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    seeds = max(len(v) for v in by.values())

    def mean(rs: list[dict[str, Any]], key: str) -> float:
        return sum(r[key] for r in rs) / len(rs)

    names = sorted(by, key=lambda n: -mean(by[n], "last_epoch_loss"))  # best ends on top
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.42 * len(names) + 1.6), sharey=True)
    for ax, key, label in (
        (axes[0], "final_acc", "final test accuracy"),
        (axes[1], "last_epoch_loss", "training loss, mean over the last epoch (lower is better)"),
    ):
        for y, name in enumerate(names):
            rs = by[name]
            colour = _PANEL_COLOURS[_panel_of(name, rs[0]["schedule"])]
            values = [r[key] for r in rs]
            if seeds > 1:
                lo, hi = min(values), max(values)
            else:
                lo, hi = rs[0][f"{key}_min"], rs[0][f"{key}_max"]
            ax.plot([lo, hi], [y, y], color=colour, lw=2.5, alpha=0.45, solid_capstyle="butt")
            ax.plot(values, [y] * len(values), "o", color=colour, ms=4)
            ax.plot([mean(rs, key)], [y], "|", color="black", ms=12, mew=1.5)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3, axis="x")
    from matplotlib.lines import Line2D

    used = sorted({_panel_of(n, by[n][0]["schedule"]) for n in names})
    axes[0].legend([Line2D([], [], color=_PANEL_COLOURS[k], lw=2.5) for k in used],
                   [_PANELS[k] for k in used], fontsize=7, loc="best")
    spread = (f"dots: {seeds} seeds, bar: their range, tick: their mean" if seeds > 1 else
              "dot: end of run, bar: range over the last epoch's evaluations (one seed)")
    fig.suptitle(f"{title}\n{spread}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return spread


def plot_depth(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Two panels against S: final test accuracy and last-epoch training loss (less noisy)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    depths = sorted({r["S"] for r in rows})
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    for name, rs in by.items():  # several seeds: their mean per depth
        per = {S: [r for r in rs if r["S"] == S] for S in depths}
        by[name] = [{"S": S, **{k: sum(r[k] for r in g) / len(g)
                                for k in ("final_acc", "last_epoch_loss")}}
                    for S, g in per.items() if g]
    for ax, key, label in (
        (axes[0], "final_acc", "final test accuracy"),
        (axes[1], "last_epoch_loss", "training loss, mean over the last epoch"),
    ):
        for name, rs in by.items():
            rs = sorted(rs, key=lambda r: r["S"])
            ax.plot([r["S"] for r in rs], [r[key] for r in rs], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths)
        ax.set_xticklabels([str(s) for s in depths])
        ax.set_xlabel("pipeline stages S")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_timelines(out: Path, stages: int, chunks: int, schedules: list[str]) -> list[Path]:
    """One schedule picture per family, drawn at the table's S and M (capped at 8 rows and 8
    micro-batches so the boxes stay readable; the title then says so), titled with what it
    draws and its bubble under the table's unit costs (F = 1, B = 2)."""
    from engine.schedule import analyze, generate, render_timeline

    paths = []
    for name in schedules:
        S = min(stages, 8)
        M = min(chunks, 8)
        if family(name).needs_chunks_ge_stages:
            M = max(M, S)
        sched = generate(name, S, M, 2, None, None)
        bubble = analyze(sched).bubble_fraction
        drawn = f"S={S} stages" + ("" if S == stages else f" (of {stages})")
        drawn += f", M={M} micro-batches" + ("" if M == chunks else f" (of {chunks})")
        if not family(name).synchronous:  # the pipeline stays full across steps (no flush):
            # two steps from an empty pipeline: fill and drain dominate the picture, but a
            # run never drains, so the table's bubble (a whole run) is near 0
            why = f"bubble {bubble:.3f} here (fill + drain); ~0 over a run, which never drains"
        else:
            why = f"bubble {bubble:.3f}, in every step: it drains every mini-batch"
        p = out / f"timeline_{name}.png"
        render_timeline(sched, p, title=f"{name}: {drawn}, 2 steps, F = 1, B = 2\n{why}")
        paths.append(p)
    return paths
