"""``python -m engine schedule NAME|FILE``: print, analyse and draw a schedule.

Why in the command line: the command a user discovers is ``python -m engine``
(``python -m engine.schedule`` runs this same subcommand); it uses only the public
``engine.schedule`` API (generate,
the rank-program families, from_csv/to_csv, format_schedule, analyze, render_timeline,
chrome_trace) and adds the one-line errors of the CLI. It prints the schedule's text form (one
row per stage, cut into blocks of tick columns that fit ``--width``) and the analysis summary
(per-stage delays, weight versions, activation peak, bubble fraction; per rank the bubble
ratio and activation peak when ranks hold several stages).

NAME is a family of the catalog (``engine.schedule.catalog.NAMES``: per-stage families such as
``1f1b`` or ``pb``, and the rank-program families ``interleaved``, ``zbv``, ``vhalf``, ``vmin``,
``dualpipev``, ``looped_bfs``, for which ``--stages`` counts ranks) or a file: a TDP CSV
(``.csv``, as torch.distributed.pipelining, torchtitan and NeMo read them) or the text form.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

from engine.cli import CLIError
from engine.schedule.catalog import NAMES, ROWS, lookup, unknown_schedule  # torch-free

__all__ = ["add_arguments", "run", "wrap_schedule_text"]

_PROGRAMS = ", ".join(f.name for f in ROWS if f.is_program)
_TAKE_V = " and ".join(f.name for f in ROWS if f.takes_virtual_stages)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "name",
        help=f"schedule: one of {', '.join(NAMES)}, or a file (.csv: TDP's CSV, "
        "else the text form)",
    )
    p.add_argument(
        "-S", "--stages", type=int, default=4,
        help=f"pipeline stages; ranks for {_PROGRAMS} (default 4)",
    )
    p.add_argument(
        "-v", "--virtual-stages", type=int, default=None,
        help=f"{_TAKE_V}: stages per rank (default 2)",
    )
    p.add_argument(
        "-M", "--chunks", type=int, default=8, help="micro-batches per mini-batch (default 8)"
    )
    p.add_argument("-T", "--steps", type=int, default=1, help="mini-batches to lay out (default 1)")
    p.add_argument(
        "-k", "--update-size", type=int, default=None, help="micro-batches per update (async)"
    )
    p.add_argument("--order", choices=("dataflow", "1f1b"), default=None, help="pb only")
    p.add_argument("--compact", action="store_true", help="omit sends/receives and ticks")
    p.add_argument(
        "--width", type=int, default=100,
        help="wrap the text form into blocks of tick columns this wide (0: one line per stage)",
    )
    p.add_argument(
        "--drop-fsdp", action="store_true",
        help="reading a CSV: skip FSDP's UNSHARD/RESHARD cells instead of refusing them",
    )
    p.add_argument("--png", default=None, help="write a timeline PNG here")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    p.add_argument("--csv", default=None, help="write the schedule as TDP's CSV here")
    p.add_argument(
        "--csv-format", choices=("compute_only", "compute_comms"), default="compute_only",
        help="--csv: TDP's format (default compute_only, what torchtitan loads)",
    )


def _load(args: argparse.Namespace):  # noqa: ANN202
    from engine.schedule import from_csv, generate, parse

    name = args.name
    path = Path(name)
    row = lookup(name)
    if row is None and (path.suffix or path.exists()):
        if not path.is_file():
            raise CLIError(f"no schedule file {name!r} (and no schedule family of that name)")
        if path.suffix.lower() == ".csv":
            return from_csv(path, name=path.stem.replace(" ", "_") or "csv", drop_fsdp=args.drop_fsdp)
        return parse(path.read_text())
    if row is None:
        raise CLIError(unknown_schedule(name, note="or give a .csv or text-form file"))
    if args.virtual_stages is not None and not row.takes_virtual_stages:
        raise CLIError(f"--virtual-stages is only for {_TAKE_V}, not {name!r}")
    if row.is_program:
        if args.update_size is not None or args.order is not None:
            raise ValueError(f"{name} takes neither --update-size nor --order")
        return row.rank_program(args.stages, args.chunks, args.steps, args.virtual_stages)
    order = None if args.order == "dataflow" else args.order
    return generate(name, args.stages, args.chunks, args.steps, args.update_size, order)


def wrap_schedule_text(text: str, width: int) -> str:
    """The text form cut for a terminal: stage lines of tick columns (``s0: a | b | ...``) are
    split into blocks of whole columns no wider than ``width`` (each block headed ``# ticks
    a-b``), other long lines wrapped with an indent. ``width`` <= 0 returns ``text``."""
    if width <= 0:
        return text
    lines = text.rstrip("\n").split("\n")
    stage = [ln for ln in lines if ln[:1] == "s" and ":" in ln and " | " in ln]
    def wrap(ls: list[str]) -> list[str]:
        return [
            w for ln in ls
            for w in textwrap.wrap(ln, width, subsequent_indent="    ", break_on_hyphens=False) or [""]
        ]

    head, tail = wrap(lines[:1]), wrap([ln for ln in lines[1:] if ln not in stage])
    if not stage or max(len(x) for x in stage) <= width:
        return "\n".join(head + [ln for ln in lines[1:] if ln in stage] + tail) + "\n"
    labels = [ln.split(":", 1)[0] + ":" for ln in stage]
    cols = [ln.split(":", 1)[1][1:].split(" | ") for ln in stage]
    lw = max(len(x) for x in labels)
    n = max(len(c) for c in cols)
    widths = [max(len(c[j]) if j < len(c) else 1 for c in cols) for j in range(n)]
    blocks: list[tuple[int, int]] = []
    start, used = 0, lw
    for j, w in enumerate(widths):
        add = w + (3 if j > start else 1)
        if j > start and used + add > width:
            blocks.append((start, j))
            start, used = j, lw + 1 + w
        else:
            used += add
    blocks.append((start, n))
    body: list[str] = []
    for a, b in blocks:
        body.append(f"# ticks {a}-{b - 1}")
        for label, c in zip(labels, cols, strict=True):
            cells = [c[j].ljust(widths[j]) for j in range(a, min(b, len(c)))]
            body.append((label.ljust(lw) + " " + " | ".join(cells)).rstrip())
    return "\n".join(head + body + tail) + "\n"


def run(args: argparse.Namespace) -> int:
    from engine.schedule import ScheduleError, analyze, chrome_trace, format_schedule, render_timeline
    from engine.schedule.tdp import to_csv

    for flag, v in (("--stages", args.stages), ("--chunks", args.chunks), ("--steps", args.steps)):
        if v < 1:
            raise CLIError(f"{flag} {v} must be >= 1")
    if args.update_size is not None and args.update_size < 1:
        raise CLIError(f"--update-size {args.update_size} must be >= 1")
    try:
        sched = _load(args)
        text = format_schedule(sched, comms=not args.compact, ticks=not args.compact)
        print(wrap_schedule_text(text, args.width), end="")
        report = analyze(sched)
        for line in report.summary().split("\n"):
            print(textwrap.fill(line, max(args.width, 40) if args.width > 0 else 10**6,
                                subsequent_indent="      "))
        if args.csv:
            Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
            to_csv(sched, args.csv, format=args.csv_format)
            print(f"wrote {args.csv}")
    except (ScheduleError, ValueError, TypeError, OSError) as exc:
        raise CLIError(str(exc)) from None
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        render_timeline(sched, args.png)
        print(f"wrote {args.png}")
    if args.trace:
        Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(sched), f)
        print(f"wrote {args.trace}")
    return 0
