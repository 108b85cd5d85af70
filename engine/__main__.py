"""Command line: ``python -m engine <command>``.

    python -m engine info                      versions, extension build, Triton mode, GPU
    python -m engine train   [options]         train a staged model on a bundled dataset
    python -m engine compare [options]         every method of the papers, one table + plots
    python -m engine schedule NAME -S 4 -M 8   print, analyse and draw a schedule
    python -m engine bench   [--smoke]         optimizer-kernel microbenchmarks
    python -m engine export  CKPT --out F      a checkpoint as the plain model's state_dict

Each subcommand lives in its own module under ``engine/cli`` and registers its options here.
Every usage error (argparse's or one a subcommand detects, e.g. more stages than layers)
prints exactly one line on stderr and exits with status 2, never a traceback: a user who
mistyped an option should see the fix, not the engine's internals. The same holds for a
missing optional package of the ``cli`` extra (tqdm, matplotlib, scikit-learn): one line that
names it and ``pip install pipeline-engine[cli]``, exit status 2. Exit status 1 means the
command ran and failed (e.g. training diverged).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from engine.cli import CLIError, CLIFailure
from engine.demo.data import DatasetError

COMMANDS = ("info", "train", "compare", "schedule", "bench", "export")

# modules of the `cli` extra (pyproject.toml) -> the package that provides them
CLI_EXTRA = {"tqdm": "tqdm", "matplotlib": "matplotlib", "sklearn": "scikit-learn"}


def _missing_cli_package(exc: BaseException) -> str | None:
    """The `cli` extra's package whose absence raised ``exc`` (itself or its direct cause:
    engine.demo.data wraps a missing scikit-learn in a DatasetError), else None."""
    for e in (exc, exc.__cause__):
        if isinstance(e, ModuleNotFoundError) and e.name in CLI_EXTRA:
            return CLI_EXTRA[e.name]
    return None


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints the usage block before its error; we print one line that names the
    command, the problem and (via the message) the fix, then exit with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="python -m engine",
        description="pipeline-engine: pipeline-parallel training for PyTorch",
        epilog="exit status: 0 success; 1 the command ran and failed (e.g. training diverged);\n"
        "2 a usage error or a missing optional package (pip install pipeline-engine[cli])",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_OneLineParser
    )
    sub.add_parser(
        "info",
        help="print versions, extension build (CUDA archs), Triton mode and GPU name",
    )
    from engine.cli import bench, compare, export, schedule, train

    for name, mod, text in (
        ("train", train, "train a model split into stages with any schedule and mitigation"),
        (
            "compare",
            compare,
            "train every method of the papers and compare them (table, plots, report)",
        ),
        (
            "schedule",
            schedule,
            "print, analyse and draw a schedule (text, PNG timeline, Chrome trace)",
        ),
        (
            "bench",
            bench,
            "optimizer-kernel microbenchmarks (bench/optim.py; needs a GPU, --smoke on CPU)",
        ),
        (
            "export",
            export,
            "write a checkpoint's model as a plain state_dict file (safetensors, model names)",
        ),
    ):
        p = sub.add_parser(name, help=text, description=(mod.__doc__ or "").split("\n")[0])
        mod.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, already printed)
        return int(exc.code or 0)
    args.argv = list(sys.argv[2:] if argv is None else argv[1:])
    if args.command == "info":
        from engine.cli import info

        return info.main()
    module = importlib.import_module(f"engine.cli.{args.command}")
    try:
        return int(module.run(args))
    except CLIError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except CLIFailure as exc:
        print(f"{parser.prog} {args.command}: failed: {exc}", file=sys.stderr)
        return 1
    except (ModuleNotFoundError, DatasetError) as exc:
        package = _missing_cli_package(exc)
        if package is None:  # not a missing optional package: a real bug, keep the traceback
            raise
        print(
            f"{parser.prog} {args.command}: error: needs {package}, which is not installed: "
            "pip install pipeline-engine[cli]",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
