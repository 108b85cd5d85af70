"""Which rank failed first: a note every rank of a multi-process pipeline can read.

Why: when one rank raises, its peers only see a receive that times out or a connection that
breaks, and each names merely its neighbour -- with 8 stages, 7 logs blame someone else. The
first rank whose step raises writes one line ("rank r: <exception>") into the job's c10d
key-value store (the one ``torch.distributed`` rendezvoused through) with ``compare_set``,
so only the first writer wins; a peer's :class:`~engine.errors.PeerError` then quotes it.
The key carries ``TORCHELASTIC_RESTART_COUNT`` so a job restarted by ``torchrun
--max-restarts`` does not read the previous attempt's note, and the number of collective calls
(steps and drains, which every rank makes in the same order) so a note from an earlier failure
the job survived (a dropped micro-batch, a rejected input) is not quoted for a later one; a
peer reads the current call's note and the previous one's (an asynchronous rank may already
wait inside the next step when its neighbour fails). Best effort: a store that is
unreachable (its host died) just leaves the message as it was.
"""

from __future__ import annotations

import os
from typing import Any

from engine.errors import NonFiniteLossError

__all__ = ["begin", "report", "first"]

_call = 0  # the collective call (step or drain) this process is in


def begin() -> None:
    """A step or drain starts: notes of earlier calls no longer describe this one's failure."""
    global _call
    _call += 1


def _key(call: int | None = None) -> str:
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"engine/first_failure/{restart}/{_call if call is None else call}"


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no process group (or a torch without the helper): nothing to share
        return None


def report(rank: int, exc: BaseException) -> None:
    """Record ``exc`` as rank ``rank``'s failure unless another rank recorded one first."""
    if isinstance(exc, NonFiniteLossError):
        return  # raised by every rank together; nobody failed first
    store = _store()
    if store is None:
        return
    line = f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0][:400] if str(exc) else ''}"
    try:
        store.compare_set(_key(), "", line)
    except Exception:
        pass


def first(rank: int) -> str:
    """" The first failure was rank k's: ..." if another rank recorded one, else ""."""
    store = _store()
    if store is None:
        return ""
    line = ""
    for call in (_call, _call - 1):
        try:
            if store.check([_key(call)]):
                line = store.get(_key(call)).decode(errors="replace")
                break
        except Exception:
            return ""
    if not line or line.startswith(f"rank {rank}:"):
        return ""
    return f" The first rank to fail in this job was {line}"
