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
wait inside the next step when its neighbour fails).

A rank killed outright writes nothing: the first neighbour whose connection with it breaks
writes the note for it ("rank k: lost: its connection with rank r broke"), so the ranks
further away name the dead rank, not the neighbour that gave up after it. Without
torchrun's agent the store lives in rank 0's process: when a rank cannot reach it, rank 0
is gone, and the message says so (rank 0 died first, or the job is ending).

Raw errors of torch.distributed that escape the transport's own handling (a collective or a
post that fails at once) become a :class:`~engine.errors.PeerError` too (:func:`as_peer_error`).
"""

from __future__ import annotations

import os
from typing import Any

import traceback

from engine.errors import NonFiniteLossError, PeerError

__all__ = ["begin", "report", "first", "as_peer_error"]

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
    peer = getattr(exc, "peer_rank", None)
    if isinstance(exc, PeerError) and getattr(exc, "broken", False) and peer is not None:
        # a neighbour killed outright wrote nothing: say it was lost, not that this rank failed
        line = f"rank {peer}: lost: its connection with rank {rank} broke (it died or was killed)"
    else:
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
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                return " (The job's store, hosted by torchrun's agent, is unreachable: the job is ending.)"
            if rank == 0:
                return ""
            return (
                " The first rank to fail in this job was rank 0: lost (the job's store, which "
                "lives in rank 0's process without torchrun's agent, is unreachable: rank 0 "
                "died, or left more than 10 s before this rank failed)"
            )
    if not line or line.startswith(f"rank {rank}:"):
        return ""
    return f" The first rank to fail in this job was {line}"


def as_peer_error(exc: BaseException, rank: int, where: str) -> BaseException:
    """``exc`` as a PeerError naming ``where`` (this rank's stage) and the first failure when
    it is a RuntimeError raised inside torch.distributed (a collective or a send that failed
    on a dead peer); any other exception unchanged."""
    if isinstance(exc, PeerError) or type(exc) is not RuntimeError:
        return exc
    frames = traceback.extract_tb(exc.__traceback__)
    if not any("torch/distributed" in f.filename.replace("\\", "/") for f in frames):
        return exc
    text = str(exc).strip()
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    why = "no answer within the timeout" if timed_out else "the connection broke"
    return PeerError(
        f"{where}: a communication with another rank failed: {why} ({text[:300]}). A peer rank "
        "most likely died or is stuck: check its log for the first error." + first(rank)
    )
