"""``python -m engine compare``: every method of the pipeline papers on real data, one command.

Why: the claims of the literature (Kosson et al.: batch-size-1 pipelined backprop with spike
compensation and linear weight prediction matches synchronous training while plain pipelined
backprop degrades with depth; Yang et al.: PipeMare's learning-rate rescheduling T1 and
discrepancy correction T2 close most of the gap of plain asynchrony) should be checkable on
any machine in minutes. This command trains the same model, split the same way, with each
method, from the same initial weights and data order, and reports what the engine itself
measured.

Setting (defaults): digits, 2 epochs, a 16-layer residual MLP split into S = 8 stages (two layers per
stage: fine-grained), one sample per micro-batch, update size k = 1 for the asynchronous
methods (the "no batches" setting) and M = S micro-batches per update for the synchronous
ones and 2BW. Hyper-parameters come from one reference (lr_ref = 0.03, m_ref = 0.9 at
B_ref = 32 samples per update, the best of lr in {0.03, 0.1, 0.3} for plain synchronous SGD)
scaled to each method's samples per update B: m = m_ref ** (B / B_ref) and
lr = lr_ref * (B / B_ref) * (1 - m) / (1 - m_ref) (see ``engine.cli.config`` for why the extra
factor: it is ALGORITHMS.md's linear rule for PyTorch's undampened momentum; ``--scaling
linear`` gives the literal rule), so every method has the same momentum time constant and the
same total step per sample. Nothing is tuned per method. The default run takes about four
minutes on two shared CPU cores.

Outputs in ``--out``: ``summary.csv``, ``report.md`` (engine/cli/report.py: the table and what
every number means), ``final_S{S}.png`` (which method is best: final test accuracy and
last-epoch training loss per method, with their spread over ``--seeds`` or, for one seed, over
the last epoch), ``curves_S{S}.png`` (test accuracy and training loss along the run, small
multiples per method family), ``timeline_{schedule}.png`` (schedule pictures from
``engine.schedule.render_timeline``), ``depth.png`` when several depths are given, and one
``metrics.csv`` per run under ``runs/``. An earlier comparison's outputs in ``--out`` stop the
command unless ``--overwrite`` deletes them first (engine/cli/outdir.py).
"""

from __future__ import annotations

import argparse
import csv
import math
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.cli import CLIError
from engine.cli.config import TrainConfig
from engine.cli.loop import TrainResult, train
from engine.cli.outdir import claim
from engine.cli.plots import plot_curves, plot_depth, plot_final, render_timelines
from engine.cli.report import write_report
from engine.cli.train import add_hparam_arguments, add_model_arguments
from engine.schedule.catalog import SCHEDULES, family

__all__ = ["METHODS", "Method", "add_arguments", "run", "method_config", "summarize"]


#: what a comparison writes in --out (module docstring)
OUTPUTS = ("summary.csv", "report.md", "runs", "final_S*.png", "curves_S*.png", "depth.png",
           "timeline_*.png")


@dataclass(frozen=True)
class Method:
    """One row of the comparison: a schedule plus mitigation options (TrainConfig overrides)."""

    name: str
    schedule: str
    options: tuple[tuple[str, Any], ...] = ()
    what: str = ""
    #: part of "--methods all" (the papers' methods; the project's own combinations run by name)
    in_all: bool = True


#: a method option: delay compensation on, with --delay-compensation's lambda (else DC_LAMBDA)
DC = "delay_compensation"
#: MXNet's DCASGD default lambda (the DC-ASGD authors' implementation)
DC_LAMBDA = 0.04

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("gpipe", "gpipe", (), "synchronous baseline (fill-drain, update per mini-batch)"),
        Method("1f1b", "1f1b", (), "synchronous, PipeDream-Flush order"),
        Method("pipedream", "pipedream", (), "async 1F1B with weight stashing, k = 1"),
        Method("2bw", "2bw", (), "PipeDream-2BW: two weight versions, delay 1, k = M"),
        Method("pb", "pb", (), "pipelined backprop, live weights, k = 1 (no mitigation)"),
        Method("pb+sc", "pb", (("spike_compensation", True),), "pb + spike compensation"),
        Method("pb+lwp", "pb", (("prediction", "lwp"),), "pb + linear weight prediction"),
        Method(
            "pb+sc+lwp",
            "pb",
            (("spike_compensation", True), ("prediction", "lwp")),
            "pb + SC + LWP (Kosson et al.'s recommendation)",
        ),
        Method("spectrain", "pb", (("prediction", "spectrain"),), "SpecTrain (F and B predicted)"),
        Method("pipemare-t1", "pb", (("pipemare_lr", True),), "PipeMare T1: lr rescheduling"),
        Method(
            "pipemare-t2",
            "pb",
            (("discrepancy_correction", True),),
            "PipeMare T2: discrepancy correction",
        ),
        Method(
            "pipemare",
            "pb",
            (("pipemare_lr", True), ("discrepancy_correction", True)),
            "PipeMare T1 + T2",
        ),
        Method("pipedream+dc", "pipedream", ((DC, True),), "stashing + delay-compensated gradients",
               in_all=False),
        Method("2bw+dc", "2bw", ((DC, True),), "2BW + delay-compensated gradients", in_all=False),
        Method(
            "pipemare-t2+dc",
            "pb",
            (("discrepancy_correction", True), (DC, True)),
            "PipeMare T2 + delay-compensated gradients (tau_s * delta as w_t - w_(t-tau))",
            in_all=False,
        ),
    )
}

def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_hparam_arguments(p)
    p.add_argument(
        "--methods",
        default="all",
        help=f"comma list of methods or 'all' (default: the papers' methods, all but "
        f"{', '.join(n for n, m in METHODS.items() if not m.in_all)}): {', '.join(METHODS)}; "
        "NAME@OPTIMIZER runs one with another optimizer (e.g. pipedream@nadam)",
    )
    p.add_argument(
        "--stages",
        default=None,
        help="pipeline depth S, or a comma list for a depth sweep, e.g. 4,8,16 (default 8; lm: 4)",
    )
    p.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="micro-batches per mini-batch M (default S: the sync methods and 2BW update every S samples)",
    )
    p.add_argument(
        "--update-size", type=int, default=1, help="k for the asynchronous methods (default 1)"
    )
    p.add_argument(
        "--target",
        type=float,
        default=0.9,
        help="test accuracy target for 'updates to target' (default 0.9)",
    )
    p.add_argument(
        "--out",
        default="out/compare",
        help="folder for the table, plots and report (default out/compare); an earlier "
        "comparison there stops the command unless --overwrite",
    )
    p.add_argument(
        "--overwrite", action="store_true",
        help="delete an earlier comparison's table, report, plots and runs/ in --out first",
    )
    p.add_argument(
        "--seeds",
        default=None,
        help="comma list of seeds, e.g. 0,1,2: every method runs once per seed, and "
        "final_S{S}.png shows the seeds' spread (default: --seed alone)",
    )
    p.set_defaults(evals_per_epoch=8, epochs=2)


def _parse_methods(text: str) -> list[Method]:
    """Methods by name; ``NAME@OPTIMIZER`` runs NAME with another optimizer than
    ``--optimizer`` (e.g. ``pipedream@nadam``), so that one comparison can pair each
    optimizer with the schedule it was proposed for."""
    from engine.cli.config import OPTIMIZERS

    if text.strip() == "all":
        return [m for m in METHODS.values() if m.in_all]
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n.partition("@")[0] not in METHODS]
    if unknown or not names:
        raise CLIError(
            f"unknown method(s) {', '.join(unknown) or repr(text)}; choose from {', '.join(METHODS)} "
            "or all (NAME@OPTIMIZER picks the optimizer of one method)"
        )
    out = []
    for name in dict.fromkeys(names):
        base, _, opt = name.partition("@")
        m = METHODS[base]
        if opt and opt not in OPTIMIZERS:
            raise CLIError(f"method {name}: optimizer {opt!r} is not one of {', '.join(OPTIMIZERS)}")
        out.append(
            replace(m, name=name, options=(*m.options, ("optimizer", opt)), what=f"{m.what}; optimizer {opt}")
            if opt else m
        )
    return out


def _parse_seeds(text: str | None, seed: int) -> list[int]:
    if text is None:
        return [seed]
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise CLIError(f"--seeds {text!r}: give a comma list of integers, e.g. 0,1,2") from None
    if not out:
        raise CLIError(f"--seeds {text!r}: give at least one seed")
    return list(dict.fromkeys(out))


def _parse_stages(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise CLIError(f"--stages {text!r}: give an integer or a comma list like 4,8,16") from None
    if not out or any(s < 1 for s in out):
        raise CLIError(f"--stages {text!r}: every depth must be >= 1")
    return sorted(dict.fromkeys(out))


def method_config(
    base: TrainConfig, method: Method, stages: int, chunks: int | None, update_size: int
) -> TrainConfig:
    """The TrainConfig of ``method`` at depth ``stages`` (shared data, model, seed, reference)."""
    M = chunks if chunks is not None else stages
    cfg = replace(
        base,
        schedule=method.schedule,
        stages=stages,
        chunks=M,
        update_size=None if family(method.schedule).per_minibatch else update_size,
        resume=False,
    )
    # --delay-compensation is the lambda of the methods with DC, the others run without it
    lam = base.delay_compensation or DC_LAMBDA
    cfg = replace(cfg, delay_compensation=0.0)
    for key, value in method.options:
        cfg = replace(cfg, **{key: lam if key == DC else value})
    return cfg


def _modal_delays(stats: dict[str, Any]) -> list[int]:
    """Per stage, the delay most micro-batches saw (steady state; fill/drain are the minority)."""
    out = []
    for counts in stats.get("measured_delays", []):
        c = Counter({int(k): int(v) for k, v in counts.items()})
        out.append(c.most_common(1)[0][0] if c else 0)
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(name: str, res: TrainResult, target: float) -> dict[str, Any]:
    """One table row from a finished run."""
    st = res.stats or {}
    rows = res.rows
    hit = next((r for r in rows if r["test_acc"] >= target), None)
    buffers = st.get("weight_buffers") or [1] * len(res.stage_param_bytes)
    act_peak = st.get("activation_peak") or [0] * len(res.stage_activation_bytes)
    last = [r for r in rows if r["epoch"] == rows[-1]["epoch"]] if rows else []
    return {
        "method": name,
        "seed": res.config.seed,
        "S": res.config.stages,
        "schedule": res.config.schedule,
        "B": res.config.samples_per_update(),
        "lr": res.lr,
        "momentum": res.momentum,
        "final_acc": res.final_test_acc,
        "best_acc": max((r["test_acc"] for r in rows), default=float("nan")),
        "last_epoch_acc": _mean([r["test_acc"] for r in rows if r["epoch"] == rows[-1]["epoch"]]),
        "last_epoch_loss": _mean(
            [r["train_loss"] for r in rows if r["epoch"] == rows[-1]["epoch"]]
        ),
        "final_loss": res.final_test_loss,
        "updates_to_target": hit["updates"] if hit else None,
        "samples_to_target": hit["samples"] if hit else None,
        "samples_per_s": res.samples_per_s,
        "weight_kib": sum(b * p for b, p in zip(buffers, res.stage_param_bytes, strict=False))
        / 1024,
        "act_kib": sum(a * b for a, b in zip(act_peak, res.stage_activation_bytes, strict=False))
        / 1024,
        "delays": "/".join(str(d) for d in _modal_delays(st)),
        "bubble": st.get("bubble_fraction", float("nan")),
        "diverged": res.diverged or "",
        # how much the two headline numbers move within the last epoch (plot_final's bars)
        "final_acc_min": min((r["test_acc"] for r in last), default=float("nan")),
        "final_acc_max": max((r["test_acc"] for r in last), default=float("nan")),
        "last_epoch_loss_min": min((r["train_loss"] for r in last), default=float("nan")),
        "last_epoch_loss_max": max((r["train_loss"] for r in last), default=float("nan")),
    }


COLUMNS = (
    ("method", "method", "{}"),
    ("S", "S", "{}"),
    ("B", "B/upd", "{}"),
    ("lr", "lr", "{:.4g}"),
    ("momentum", "m", "{:.4f}"),
    ("final_acc", "final acc", "{:.4f}"),
    ("last_epoch_acc", "last-epoch mean", "{:.4f}"),
    ("best_acc", "best acc", "{:.4f}"),
    ("last_epoch_loss", "train loss", "{:.3f}"),
    ("updates_to_target", "upd→target", "{}"),
    ("samples_to_target", "samples→target", "{}"),
    ("samples_per_s", "samples/s", "{:.0f}"),
    ("weight_kib", "weights KiB", "{:.0f}"),
    ("act_kib", "act KiB", "{:.1f}"),
    ("delays", "delays (stage 0..S-1)", "{}"),
    ("bubble", "bubble", "{:.3f}"),
)


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    v = row[key]
    if key == "method" and row.get("seeds", 1) > 1:
        return f"{v} (seed {row['seed']})"
    if v is None:
        return "never"
    if isinstance(v, float) and math.isnan(v):
        return "-"
    s = fmt.format(v)
    if key == "final_acc" and row["diverged"]:
        s += " (diverged)"
    return s


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(_cell(r, k, f) for k, _, f in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def text_table(rows: list[dict[str, Any]]) -> str:
    cells = [[h for _, h, _ in COLUMNS]] + [[_cell(r, k, f) for k, _, f in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(COLUMNS))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_summary(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


# ------------------------------------------------------------------ entry point


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.cli.config import TASK_DEFAULTS, check_config, config_from_args

    t_start = time.perf_counter()
    methods = _parse_methods(args.methods)
    seeds = _parse_seeds(args.seeds, args.seed)
    depths = _parse_stages(args.stages or str(TASK_DEFAULTS[args.task]["stages"]))
    if args.chunks is not None and args.chunks < 1:
        raise CLIError(f"--chunks {args.chunks} must be >= 1")
    if args.update_size < 1:
        raise CLIError(f"--update-size {args.update_size} must be >= 1")
    if not 0 < args.target <= 1:
        raise CLIError(f"--target {args.target} must be an accuracy in (0, 1]")
    out = Path(args.out)
    base = config_from_args(
        argparse.Namespace(**{**vars(args), "stages": depths[0], "schedule": "pb"})
    )
    configs = [
        (m, S, replace(method_config(base, m, S, args.chunks, args.update_size), seed=seed))
        for seed in seeds
        for S in depths
        for m in methods
    ]
    for m, S, cfg in configs:  # every configuration is checked before the first run starts
        try:
            check_config(cfg)
        except CLIError as exc:
            raise CLIError(f"method {m.name} at S={S}: {exc}") from None
        if family(cfg.schedule).needs_chunks_ge_stages and cfg.chunks < S:
            raise CLIError(
                f"method {m.name} needs --chunks >= stages (M >= S); got --chunks {cfg.chunks} "
                f"with S={S}"
            )
    claim(out, OUTPUTS, overwrite=getattr(args, "overwrite", False))
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    by_depth: dict[int, list[tuple[str, TrainResult]]] = {}
    overall = tqdm(  # a bar on a terminal only; the per-run lines below are printed either way
        total=len(configs), desc="compare", unit="run",
        disable=not (args.progress and sys.stderr.isatty()), file=sys.stderr,
    )
    for i, (m, S, cfg) in enumerate(configs):
        tag = f"S{S}-{m.name}" + (f"-seed{cfg.seed}" if len(seeds) > 1 else "")
        cfg = replace(cfg, out=str(out / "runs" / tag))
        res = train(cfg, save=True, desc=f"S={S} {m.name}", position=1)
        row = summarize(m.name, res, args.target)
        row["seeds"] = len(seeds)
        rows.append(row)
        if cfg.seed == seeds[0]:  # the curves show the first seed's runs
            by_depth.setdefault(S, []).append((m.name, res))
        overall.update(1)
        msg = (
            f"[{i + 1}/{len(configs)}] S={S} {m.name:12s}"
            + (f" seed {cfg.seed}" if len(seeds) > 1 else "")
            + f" acc {row['final_acc']:.4f} "
            f"({row['samples_per_s']:.0f} samples/s)"
            + (f" DIVERGED: {res.diverged}" if res.diverged else "")
        )
        if args.progress:
            overall.write(msg, file=sys.stderr)
    overall.close()
    order = {m.name: k for k, m in enumerate(methods)}
    rows.sort(key=lambda r: (r["S"], order[r["method"]], r["seed"]))  # a method's seeds together
    images: list[Path] = []
    spread = ""
    for S, results in by_depth.items():
        setting = f"{base.data_name}: S={S} stages, {base.layers} layers, {base.batch_size} sample/micro-batch"
        p = out / f"final_S{S}.png"
        spread = plot_final([r for r in rows if r["S"] == S], p, setting)
        images.append(p)
        p = out / f"curves_S{S}.png"
        plot_curves(results, p, setting + (f", seed {seeds[0]}" if len(seeds) > 1 else ""))
        images.append(p)
    if len(depths) > 1:
        p = out / "depth.png"
        plot_depth(rows, p, f"{base.data_name}: accuracy and loss vs pipeline depth")
        images.append(p)
    scheds = [s for s in SCHEDULES if any(m.schedule == s for m in methods)]  # catalog order
    images += render_timelines(out, depths[-1], args.chunks or depths[-1], scheds)
    wall = time.perf_counter() - t_start
    command = "python -m engine compare " + " ".join(
        shlex.quote(a) for a in (getattr(args, "argv", None) or [])
    )
    write_summary(out / "summary.csv", rows)
    write_report(
        out / "report.md", markdown_table(rows), base, [(m.name, m.what) for m in methods],
        depths, images, command.strip(), wall, args.target, seeds, spread,
    )
    print(text_table(rows))
    print(
        f"\nwall time {wall:.0f} s; wrote {out / 'report.md'}, {out / 'summary.csv'}, "
        f"{len(images)} PNGs in {out}"
    )
    return 0
