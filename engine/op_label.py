"""Labels for communication ops, read by the NCCL twin's deadlock report and by profilers.

Why a context variable: the code that posts an op (a transport's ``isend``, a
``batch_isend_irecv`` list) knows what the op carries ("act mb 3 stage 1->2"); whatever records
the op (``engine.testing.nccl_twin``, a profiler hook) sits below torch's API and cannot be
passed an argument. The poster wraps the call in :func:`labelled`; the recorder reads
:data:`OP_LABEL` at posting time. A leaf without torch, so production code can import it
without pulling in test tooling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["OP_LABEL", "labelled"]

#: the label of the ops posted now, or None when the poster set none
OP_LABEL: ContextVar[str | None] = ContextVar("engine_op_label", default=None)


@contextlib.contextmanager
def labelled(text: str) -> Iterator[None]:
    """Label the ops posted inside the ``with`` block (nested blocks: the innermost wins)."""
    if not isinstance(text, str):
        raise TypeError(f"an op label is a str, got {type(text).__name__}: {text!r}")
    token = OP_LABEL.set(text)
    try:
        yield
    finally:
        OP_LABEL.reset(token)
