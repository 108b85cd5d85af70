"""Keep docs/results.md's comparison tables the output of the commands they quote.

Why: a table pasted by hand drifts from the command above it (a changed default, a rerun on
another machine) and nothing notices: the default table once claimed no cell had moved while
a fresh run on another CPU read other spectrain cells. In docs/results.md a table printed in
full by ``python -m engine compare`` is preceded by a marker naming its command and the CPU
kernels torch ran (its reductions round differently under AVX2 and AVX512, which moves a few
cells):

    <!-- compare-table: python -m engine compare --stages 4,8,16 | cpu: AVX512 -->

This script rewrites the marked table from a run's ``report.md`` (after checking that the run's
command is the marker's, ``--out`` and ``--no-progress`` aside), or checks that they agree:

    python -m engine compare --stages 4,8,16 --out out/depth
    python bench/results_doc.py out/depth              # rewrite the table in docs/results.md
    python bench/results_doc.py out/depth --check      # exit 1 naming every cell that differs

``--check`` ignores the samples/s column (other jobs on a shared machine set it) and, with
``--methods``, compares only the rows of those methods: a run of two methods checks their
rows of the full table (each method's run is independent of the others').
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

__all__ = ["MARKER", "command_key", "report_table", "marked_tables", "differences", "rewrite"]

DOC = Path(__file__).resolve().parents[1] / "docs" / "results.md"
MARKER = re.compile(r"^<!-- compare-table: (?P<command>.+?) \| cpu: (?P<cpu>\S+) -->$")
NOISE = ("samples/s",)  # columns that other jobs on the machine set
_DROPPED = {"--no-progress": 0, "--progress": 0, "--out": 1}  # option -> values it takes


def command_key(command: str) -> tuple[str, ...]:
    """The command's words without the options that do not change the table."""
    words = shlex.split(command)
    out: list[str] = []
    skip = 0
    for w in words:
        if skip:
            skip -= 1
            continue
        name = w.split("=", 1)[0]
        if name in _DROPPED:
            skip = _DROPPED[name] if "=" not in w else 0
            continue
        out.append(w)
    return tuple(out)


def report_table(out: Path) -> tuple[str, str, list[str]]:
    """(command, torch CPU capability, table lines) of the ``report.md`` in ``out``."""
    path = out / "report.md"
    try:
        text = path.read_text()
    except OSError as exc:
        raise SystemExit(f"results_doc: cannot read {path}: {exc.strerror or exc}") from None
    command = re.search(r"^Command: `(.+)`$", text, re.M)
    cpu = re.search(r"torch CPU kernels (\S+?)[,.)]", text)
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("| method |")), None)
    if command is None or cpu is None or start is None:
        raise SystemExit(f"results_doc: {path} has no Command line, CPU kernels or table; "
                         "is it the report.md of python -m engine compare?")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return command[1], cpu[1], lines[start:end]


def marked_tables(text: str) -> dict[tuple[str, ...], tuple[int, int, str]]:
    """Per marked command (:func:`command_key`): the table's first and end line and its CPU."""
    lines = text.splitlines()
    out = {}
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if m is None:
            continue
        start = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("|"))
        end = start
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        out[command_key(m["command"])] = (start, end, m["cpu"])
    return out


def _cells(table: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(header, rows by their first cells up to the bubble column's left: method and S)."""
    split = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in table]
    header, rows = split[0], split[2:]
    return header, {f"{r[0]} S={r[1]}": r for r in rows}


def differences(doc: list[str], fresh: list[str], methods: set[str] | None = None) -> list[str]:
    """Every cell of ``fresh`` that differs from ``doc`` (noise columns aside), as lines."""
    header, want = _cells(doc)
    fresh_header, got = _cells(fresh)
    if header != fresh_header:
        return [f"the columns differ: {header} vs {fresh_header}"]
    out = []
    keys = [k for k in want if methods is None or k.split(" S=")[0] in methods]
    for key in keys:
        if key not in got:
            out.append(f"{key}: missing from the run")
            continue
        for col, a, b in zip(header, want[key], got[key], strict=True):
            if a != b and col not in NOISE:
                out.append(f"{key}, {col}: the doc says {a}, the run {b}")
    out += [f"{k}: not in the doc's table" for k in got if k not in want]
    return out


def rewrite(doc_text: str, command: str, cpu: str, table: list[str]) -> str:
    """``doc_text`` with the table marked for ``command`` replaced by ``table``."""
    tables = marked_tables(doc_text)
    key = command_key(command)
    if key not in tables:
        raise SystemExit(f"results_doc: no table of `{command}` is marked in the doc; markers: "
                         + "; ".join(" ".join(k) for k in tables))
    start, end, _ = tables[key]
    lines = doc_text.splitlines()
    marker = start - 1 - next(j for j, ln in enumerate(reversed(lines[:start])) if MARKER.match(ln))
    lines[marker] = MARKER.sub(lambda m: f"<!-- compare-table: {m['command']} | cpu: {cpu} -->", lines[marker])
    lines[start:end] = table
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the --out folder of a python -m engine compare run")
    p.add_argument("--doc", type=Path, default=DOC, help="the markdown file (default docs/results.md)")
    p.add_argument("--check", action="store_true", help="compare instead of rewriting")
    p.add_argument("--against", default=None,
                   help="with --check: the marked command to compare with (default: the run's own)")
    args = p.parse_args(argv)
    command, cpu, table = report_table(args.out)
    text = args.doc.read_text()
    if not args.check:
        args.doc.write_text(rewrite(text, command, cpu, table))
        print(f"rewrote the table of `{' '.join(command_key(command))}` in {args.doc}")
        return 0
    tables = marked_tables(text)
    key = command_key(args.against or command)
    methods = None
    if args.against is not None:  # a run of some methods checks their rows
        words = command_key(command)
        methods = set(words[words.index("--methods") + 1].split(",")) if "--methods" in words else None
    if key not in tables:
        print(f"results_doc: no table of `{' '.join(key)}` is marked in {args.doc}", file=sys.stderr)
        return 1
    start, end, doc_cpu = tables[key]
    if doc_cpu != cpu:
        print(f"results_doc: the doc's table was made with torch's {doc_cpu} CPU kernels, this run "
              f"with {cpu}: their rounding differs, so cells may too", file=sys.stderr)
    diffs = differences(text.splitlines()[start:end], table, methods)
    for line in diffs:
        print(line)
    print(f"{len(diffs)} cell(s) differ" if diffs else "every cell agrees (samples/s aside)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
