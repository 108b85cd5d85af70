"""Command line: ``python -m engine <command>``.

Each subcommand lives in its own module and registers itself here; argument errors print
one line and exit with status 2 (argparse's convention), never a traceback.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine",
        description="pipeline-engine: pipeline-parallel training for PyTorch",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "info",
        help="print versions, extension build (CUDA archs), Triton mode and GPU name",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "info":
        from engine import info

        return info.main()
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
