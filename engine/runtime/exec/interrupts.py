"""Ctrl-C inside a step, delivered at the next action boundary.

Why: a KeyboardInterrupt raised in the middle of an optimizer step leaves a stage half
updated (weights moved, momentum not), and one raised between two bookkeeping statements of
the runtime leaves it inconsistent. While a step or a flush runs (main thread only; other
threads never receive SIGINT), the first Ctrl-C only sets a flag; the executor checks it
between actions and raises KeyboardInterrupt there, where everything is consistent. A second
Ctrl-C while one is pending interrupts at once (for a stage that never returns), with the
in-action semantics of :mod:`engine.runtime.exec.executor`.

Only Python's default handler is replaced, for the length of the step. A handler the program
installed is left alone (it decided what a Ctrl-C means), and so is an ignored SIGINT
(``SIG_IGN``, which a process started in the background with ``&`` or ``nohup`` inherits, and
Python then installs no handler): nothing is deferred, the Ctrl-C stays ignored and the step
runs to its end. Deferring a signal the program ignores would turn it into a
KeyboardInterrupt the program asked never to see.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:  # signal's own calls without its enum wrappers (which cost host time at two calls a
    import _signal as _raw  # step: docs/design-notes.md)
except ImportError:  # pragma: no cover - not CPython
    _raw = signal  # type: ignore[no-redef]

__all__ = ["Interrupts"]


class Interrupts:
    """Defers Ctrl-C to the executor's next action boundary (main thread only); a second
    Ctrl-C while one is pending interrupts at once."""

    def __init__(self) -> None:
        self.pending = False

    def _handler(self, signum: int, frame: Any) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    @contextmanager
    def deferred(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        try:
            previous = _raw.getsignal(signal.SIGINT)
        except ValueError:  # pragma: no cover - no signals here
            yield
            return
        if previous is not signal.default_int_handler:
            yield  # the program's own handler, or SIGINT ignored: leave it as it is
            return
        _raw.signal(signal.SIGINT, self._handler)
        try:
            yield
        finally:
            _raw.signal(signal.SIGINT, previous)

    def check(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt
