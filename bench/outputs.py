"""Where a benchmark writes when ``--out`` is not given: ``out/bench`` under the current folder.

Why not ``bench/results``: that folder holds the repository's tracked results, the numbers the
READMEs quote; a smoke run started from the repository's root replaced them without a word.
They are rewritten only when ``--out bench/results`` says so; every other run lands beside the
other commands' outputs (``out/train``, ``out/compare``), which git ignores.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEFAULT_OUT"]

DEFAULT_OUT = Path("out/bench")
