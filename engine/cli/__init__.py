"""Subcommands of ``python -m engine``, one module each.

Why one module per subcommand: each owns its options (``add_arguments``) and its entry point
(``run``), so ``engine/__main__.py`` only wires them together and a subcommand can be read,
tested and imported on its own (``compare`` reuses ``train``'s options and its loop, which
live in ``config``, ``loop`` and ``runlog`` beside ``train``). Heavy imports (torch,
matplotlib, scikit-learn) happen inside ``run`` so ``python -m engine --help`` is fast.

Errors the user can fix raise :class:`CLIError`; ``__main__`` prints them as one line on
stderr and exits with status 2, argparse's convention for bad usage.
"""

from __future__ import annotations

__all__ = ["CLIError", "CLIFailure"]


class CLIError(Exception):
    """A usage error: printed as ``python -m engine CMD: error: MESSAGE`` with exit status 2."""


class CLIFailure(Exception):
    """The command ran and failed for a reason outside the program (a full disk, a read-only
    output folder, a corrupt state file): one line, exit status 1, earlier results intact."""
