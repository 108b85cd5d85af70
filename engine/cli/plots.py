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

__all__ = ["plot_curves", "plot_depth", "render_timelines"]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: panels of the curves figure: methods grouped by how their forwards read weights
_PANELS = (
    "synchronous (no staleness)",
    "weight stashing",
    "live weights, pipelined backpropagation",
)
_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")


def _panel_of(res: TrainResult) -> int:
    fam = family(res.config.schedule)  # the catalog says how a family reads weights
    if fam.synchronous:
        return 0
    return 2 if fam.live_async else 1


def plot_curves(results: list[tuple[str, TrainResult]], path: Path, title: str) -> None:
    """Small multiples: one column per method family (synchronous, stashing, live weights),
    test accuracy on top and training loss below; inside a panel every method has its own
    colour, line style and marker, and the first synchronous method is drawn in grey in every
    other panel as the reference (gpipe and 1f1b compute the same thing, so one of them
    would otherwise hide the other: the second is drawn dashed with markers)."""
    plt = _plt()
    groups: list[list[tuple[str, TrainResult]]] = [[] for _ in _PANELS]
    for name, res in results:
        if res.rows:
            groups[_panel_of(res)].append((name, res))
    cols = [k for k, g in enumerate(groups) if g] or [0]
    fig, axes = plt.subplots(2, len(cols), figsize=(5.2 * len(cols), 7.2), squeeze=False)
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


def plot_depth(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Two panels against S: final test accuracy and last-epoch training loss (less noisy)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    depths = sorted({r["S"] for r in rows})
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
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
        p = out / f"timeline_{name}.png"
        render_timeline(sched, p, title=f"{name}: {drawn}, 2 steps; bubble {bubble:.3f} (F = 1, B = 2)")
        paths.append(p)
    return paths
