"""``python -m engine schedule NAME --stages S --chunks M``: print, analyse and draw a schedule.

Why here as well as ``python -m engine.schedule``: the command line a user discovers is
``python -m engine``; this subcommand uses only the public ``engine.schedule`` API (generate,
format_schedule, analyze, render_timeline, chrome_trace) and adds the one-line errors of the
CLI. It prints the schedule's text form (one row per stage) and the analysis summary
(per-stage delays, weight versions, activation peak, bubble fraction).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.cli import CLIError
from engine.schedule.catalog import SCHEDULES as NAMES  # the catalog is torch-free
from engine.schedule.interleaved import NAME as INTERLEAVED  # not a catalog row (see there)

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help=f"schedule: one of {', '.join(NAMES)} or {INTERLEAVED}")
    p.add_argument(
        "-S", "--stages", type=int, default=4, help="pipeline stages (ranks for interleaved; 4)"
    )
    p.add_argument(
        "-v", "--virtual-stages", type=int, default=None,
        help="interleaved only: virtual stages per rank (default 2)",
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
    p.add_argument("--png", default=None, help="write a timeline PNG here")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")


def run(args: argparse.Namespace) -> int:
    from engine.schedule import (
        ScheduleError,
        analyze,
        chrome_trace,
        format_schedule,
        generate,
        interleaved,
        render_timeline,
    )

    if args.name not in (*NAMES, INTERLEAVED):
        raise CLIError(
            f"unknown schedule {args.name!r}; choose one of {', '.join(NAMES)}, {INTERLEAVED}"
        )
    if args.virtual_stages is not None and args.name != INTERLEAVED:
        raise CLIError(f"--virtual-stages is only for {INTERLEAVED}, not {args.name!r}")
    for flag, v in (("--stages", args.stages), ("--chunks", args.chunks), ("--steps", args.steps)):
        if v < 1:
            raise CLIError(f"{flag} {v} must be >= 1")
    if args.update_size is not None and args.update_size < 1:
        raise CLIError(f"--update-size {args.update_size} must be >= 1")
    order = None if args.order == "dataflow" else args.order
    try:
        if args.name == INTERLEAVED:
            if args.update_size is not None or args.order is not None:
                raise ValueError("interleaved takes neither --update-size nor --order")
            v = 2 if args.virtual_stages is None else args.virtual_stages
            sched = interleaved(args.stages, v, args.chunks, args.steps)
        else:
            sched = generate(
                args.name, args.stages, args.chunks, args.steps, args.update_size, order
            )
    except (ScheduleError, ValueError, TypeError) as exc:
        raise CLIError(str(exc)) from None
    print(format_schedule(sched, comms=not args.compact, ticks=not args.compact), end="")
    print(analyze(sched).summary())
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
