"""Merge the outputs of several ``python -m engine compare`` runs (e.g. one per seed, or one
per group of methods) into one Markdown table and one figure.

Why: a comparison over seeds and depths is several commands (a machine with 2 cores runs one
at a time), and docs/results.md wants one table with the spread per method and depth. Every
number comes from the runs' ``summary.csv`` and ``runs/S*-METHOD/metrics.csv``; nothing is
recomputed.

    python bench/compare_table.py OUT_DIR [OUT_DIR ...] --png curves.png

A directory's seed is read from its ``report.md`` (the command line it records).
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
from collections import defaultdict
from pathlib import Path


def _seed(out: Path) -> int:
    report = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    m = re.search(r"--seed[ =](\d+)", report)
    return int(m.group(1)) if m else 0


def load(dirs: list[Path]) -> dict[tuple[str, int], dict[int, dict[str, str]]]:
    """(method, S) -> seed -> summary row."""
    rows: dict[tuple[str, int], dict[int, dict[str, str]]] = defaultdict(dict)
    for out in dirs:
        seed = _seed(out)
        with open(out / "summary.csv", newline="") as f:
            for r in csv.DictReader(f):
                rows[(r["method"], int(r["S"]))][seed] = r | {"_dir": str(out)}
    return rows


def _cell(values: list[float], fmt: str) -> str:
    text = " / ".join(fmt.format(v) for v in values)
    if len(values) > 1:
        text += f" ({fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values))})"
    return text


def table(rows: dict[tuple[str, int], dict[int, dict[str, str]]]) -> str:
    lines = [
        "| method | S | B/upd | test acc (seeds in order; mean ± sd) | test loss | seeds | weights KiB | delays |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (method, S), by_seed in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        seeds = sorted(by_seed)
        first = by_seed[seeds[0]]
        acc = [float(by_seed[s]["final_acc"]) for s in seeds]
        loss = [float(by_seed[s]["final_loss"]) for s in seeds]
        lines.append(
            f"| {method} | {S} | {first['B']} | {_cell(acc, '{:.3f}')} | {_cell(loss, '{:.3f}')} | "
            f"{','.join(map(str, seeds))} | {float(first['weight_kib']):.0f} | {first['delays']} |"
        )
    return "\n".join(lines)


def plot(rows: dict[tuple[str, int], dict[int, dict[str, str]]], path: Path) -> None:
    """Test loss against samples, seed 0 (or the lowest seed), one panel per depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({S for _, S in rows})
    fig, axes = plt.subplots(1, len(depths), figsize=(6.5 * len(depths), 4.6), squeeze=False)
    cmap = plt.get_cmap("tab20")
    methods = sorted({m for m, _ in rows})
    for ax, S in zip(axes[0], depths, strict=True):
        for k, method in enumerate(methods):
            by_seed = rows.get((method, S))
            if not by_seed:
                continue
            r = by_seed[min(by_seed)]
            with open(Path(r["_dir"]) / "runs" / f"S{S}-{method}" / "metrics.csv", newline="") as f:
                pts = [(int(x["samples"]), float(x["test_loss"])) for x in csv.DictReader(f)]
            style = "-" if "@" not in method and "+" not in method else ("--" if "@" in method else ":")
            ax.plot(*zip(*pts, strict=True), style, color=cmap(k % 20), marker="os^vDPX*"[k % 8],
                    markersize=3, label=method)
        ax.set_title(f"S = {S} stages (seed {min(min(v) for (m, s), v in rows.items() if s == S)})")
        ax.set_xlabel("training samples")
        ax.set_ylabel("test loss (nats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path, help="compare --out directories")
    p.add_argument("--png", type=Path, default=None, help="write the test-loss curves here")
    args = p.parse_args()
    rows = load(args.dirs)
    print(table(rows))
    if args.png is not None:
        plot(rows, args.png)
        print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
