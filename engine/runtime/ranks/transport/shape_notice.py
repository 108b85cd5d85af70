"""Per-step shape notices (NCCL): which micro-batches' activations travel with a header.

Why: under NCCL a receive must post the exact size of the message, and learning it from an
in-band header would cost a device synchronisation per activation (the header is device
memory). Tensor shapes between stages follow from the first stage's input shapes (the engine
already assumes that when it dry-runs each stage once per new set of input shapes), and the
first stage's rank knows all of a step's input shapes before the step starts. So that rank
sends every other rank of its pipeline, once per step on the control plane (gloo, host
memory), the micro-batches whose input shapes differ from those of the micro-batch before
them. Only their activations carry a header (nccl.py); all others travel as their leaves
alone, so a step with static shapes makes no host read and no message beyond this one.

A notice is ``[base, error bytes, M, flag x M]`` (int64) for the step's micro-batches
``base .. base+M-1`` (ids within the segment, as the lane numbers them), followed by the
error text when the first stage refused the step's inputs: every rank then raises the same
:class:`~engine.errors.PipelineInputError` before the step, and nothing travels on NCCL.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.errors import PeerError, PipelineInputError
from engine.runtime.ranks.transport.control import NOTICE_TAG
from engine.runtime.stage import trees

__all__ = ["ShapeNotices"]

#: how many steps of flags are kept (messages of a micro-batch travel within a few steps)
_KEEP_STEPS = 64


def _shapes(x: Any) -> tuple[tuple[int, ...], ...]:
    if isinstance(x, Tensor):
        return (tuple(x.shape),)
    return tuple(tuple(t.shape) for t in trees.tensors(x))


class ShapeNotices:
    """One rank's table of micro-batches whose activations carry a header (module
    docstring). ``calls``: the control plane's calls; ``ranks``: the pipeline's global ranks;
    ``first``: the global rank holding stage 0; ``me``: this rank; ``M``: chunks."""

    def __init__(self, calls: Any, ranks: list[int], first: int, me: int, M: int, wait: Any) -> None:
        self.calls = calls
        self.ranks = [r for r in dict.fromkeys(ranks)]
        self.first = first
        self.me = me
        self.M = M
        self._wait = wait  # (work, what) -> None: a host wait with the pipeline's timeout
        self._flags: dict[int, bool] = {}
        self._last: tuple[tuple[int, ...], ...] | None = None  # stage 0: last input's shapes
        self._sends: list[tuple[Any, Tensor]] = []
        #: notices received or sent (a counter the tests read)
        self.count = 0

    def header(self, mb: int) -> bool:
        """Whether micro-batch ``mb``'s activations travel with a header."""
        return self._flags.get(mb, False)

    def seen(self, x: Any) -> None:
        """Stage 0: ``x`` is the input the handshake agreed (the reference of step 0's first
        micro-batch)."""
        self._last = _shapes(x)

    def _record(self, base: int, flags: list[bool]) -> None:
        for i, f in enumerate(flags):
            self._flags[base + i] = f
        stale = [k for k in self._flags if k < base - _KEEP_STEPS * self.M or k >= base + self.M]
        for k in stale:  # (ids restart at a segment's start: later ids are of an older one)
            del self._flags[k]
        self.count += 1

    def announce(self, xs: list[Any], base: int, error: str = "") -> None:
        """Stage 0's rank, before the step: flag the micro-batches of ``xs`` whose input
        shapes differ from the one before, and tell every other rank (or tell them
        ``error``, the reason this rank refuses the step)."""
        flags: list[bool] = []
        if not error:
            for x in xs:
                key = _shapes(x)
                flags.append(key != self._last)
                self._last = key
        body = error.encode()
        head = torch.tensor([base, len(body), self.M, *(int(f) for f in flags or [0] * self.M)],
                            dtype=torch.int64)
        for work, _t in self._sends:  # the previous step's: received long ago
            self._wait(work, "sending the previous step's shape notice")
        self._sends = []
        msgs = [head] + ([torch.frombuffer(bytearray(body), dtype=torch.uint8)] if body else [])
        for r in self.ranks:
            if r == self.me:
                continue
            for t in msgs:
                self._sends.append((self.calls.send(t, r, NOTICE_TAG), t))
        if error:
            for work, _t in self._sends:
                self._wait(work, "sending the step's input error")
            self._sends = []
            return
        self._record(base, flags)

    def receive(self, base: int) -> None:
        """Every other rank, before the step: the first stage's notice for this step (raises
        its error when it refused the step's inputs)."""
        head = torch.zeros(3 + self.M, dtype=torch.int64)
        self._wait(self.calls.recv(head, self.first, NOTICE_TAG), "receiving the step's shape notice")
        got_base, n, M, *flags = head.tolist()  # (host memory: a gloo buffer)
        if n > 0:
            body = torch.empty(n, dtype=torch.uint8)
            self._wait(self.calls.recv(body, self.first, NOTICE_TAG), "receiving the step's input error")
            self.count += 1
            raise PipelineInputError(body.numpy().tobytes().decode(errors="replace"))
        if got_base != base or M != self.M:
            raise PeerError(
                f"rank {self.me} expected the shape notice of micro-batches {base}..{base + self.M - 1} "
                f"but rank {self.first} sent one for {got_base}..{got_base + M - 1}: the ranks are "
                "not running the same steps (every rank must call step() and flush() alike)"
            )
        self._record(base, [bool(v) for v in flags])

    def settle(self) -> list[Any]:
        """The works still in flight (for the exit's teardown)."""
        works = [w for w, _t in self._sends]
        self._sends = []
        return works
