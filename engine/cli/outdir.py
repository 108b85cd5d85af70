"""An output folder holds one run: a command never writes over an earlier run's outputs unasked.

Why: the commands write to fixed default folders (``out/train``, ``out/compare``,
``out/bench``), so a second run with other options would silently replace the first one's
checkpoint, metrics or table, and a later ``--resume`` or a reader of the report would take
one run's files for another's. Before it starts, a command looks in its ``--out`` for the files
it writes; if an earlier run left any there it stops with one line that names them and the
ways on: ``--resume`` (``train``: continue that run), ``--overwrite`` (delete the earlier
run's outputs, then write), or ``--out DIR`` (a new folder). Files it does not write are never
looked at nor touched.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from engine.cli import CLIError, CLIFailure

__all__ = ["earlier_outputs", "claim"]


def earlier_outputs(out: Path, patterns: Iterable[str]) -> list[Path]:
    """The paths in ``out`` matching ``patterns`` (file or folder names, globs allowed), sorted."""
    if not out.is_dir():
        return []
    found = {p for pattern in patterns for p in out.glob(pattern)}
    return sorted(found)


def claim(out: Path, patterns: Iterable[str], *, overwrite: bool, can_resume: bool = False) -> None:
    """Make ``out`` this run's: refuse when an earlier run's outputs are there (a CLIError
    naming them and the options that go on), or with ``overwrite`` delete them first."""
    found = earlier_outputs(out, patterns)
    if not found:
        return
    if not overwrite:
        names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in found)
        ways = "continue that run with --resume, " if can_resume else ""
        raise CLIError(
            f"{out} holds an earlier run's outputs ({names}); {ways}replace them with "
            "--overwrite, or write this run to a new folder with --out DIR"
        )
    for p in found:
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        except OSError as exc:
            raise CLIFailure(
                f"--overwrite: cannot delete {p}: {exc.strerror or exc}; the command stopped before it ran"
            ) from None
