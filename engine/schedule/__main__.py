"""``python -m engine.schedule NAME|FILE ...``: the command line's ``schedule`` subcommand
(``python -m engine schedule``, engine/cli/schedule.py) under its first name -- one command
that prints, checks and draws a schedule. ``--file PATH`` is the older spelling of the
positional FILE; the text form prints unwrapped unless ``--width`` says otherwise."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from engine.__main__ import main as cli

    args = list(sys.argv[1:] if argv is None else argv)
    if "--file" in args[:-1]:
        at = args.index("--file")
        args[at:at + 2] = [args[at + 1]]
    return cli(["schedule", "--width", "0", *args])


if __name__ == "__main__":
    raise SystemExit(main())
