"""``python -m engine.schedule NAME -S 4 -M 8``: print, check and draw a schedule.

Why a command: looking at a schedule (its text form, its delays and bubble, its timeline)
is the fastest way to understand or debug one, and needs no Python session.

    python -m engine.schedule pb -S 3 -M 3 --steps 2 --png pb.png --trace pb.json
    python -m engine.schedule 1f1b -S 4 -M 8 --compact
    python -m engine.schedule --file my_schedule.txt      # validate a hand-written one
    python -m engine.schedule --file zbv.csv              # or a TDP CSV (engine.schedule.tdp)
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.schedule.analysis import analyze
from engine.schedule.errors import ScheduleError
from engine.schedule.catalog import NAMES
from engine.schedule.generators import generate
from engine.schedule.ir import Schedule
from engine.schedule.render import chrome_trace, render_timeline
from engine.schedule.text import format_schedule, parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.schedule", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "name", nargs="?", choices=NAMES,
        help="schedule to generate (a rank-program family over -S stages: the V on S/2 ranks)",
    )
    p.add_argument("-S", "--stages", type=int, default=4)
    p.add_argument("-M", "--chunks", type=int, default=8)
    p.add_argument("-T", "--steps", type=int, default=1)
    p.add_argument("-k", "--update-size", type=int, default=None)
    p.add_argument("--order", default=None, help="pb only: dataflow (default) or 1f1b")
    p.add_argument(
        "--file", help="read a schedule (text form, or TDP's CSV when it ends in .csv)"
    )
    p.add_argument("--compact", action="store_true", help="print without sends/receives and ticks")
    p.add_argument("--png", help="write a timeline PNG here")
    p.add_argument("--trace", help="write a Chrome trace JSON here")
    args = p.parse_args(argv)
    try:
        if args.file and args.file.lower().endswith(".csv"):
            from engine.schedule.tdp import from_csv

            sched: Schedule = from_csv(args.file)
        elif args.file:
            with open(args.file) as f:
                sched = parse(f.read())
        elif args.name:
            sched = generate(
                args.name, args.stages, args.chunks, args.steps, args.update_size, args.order
            )
        else:
            p.error("give a schedule name or --file")
        compact = args.compact
        print(format_schedule(sched, comms=not compact, ticks=not compact), end="")
        print(analyze(sched).summary())
        if args.png:
            render_timeline(sched, args.png)
        if args.trace:
            with open(args.trace, "w") as f:
                json.dump(chrome_trace(sched), f)
    except (ScheduleError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
