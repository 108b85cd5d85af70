"""The per-stage compute orders of the stream families: what one stage computes, in order.

Why a module of its own: a family's order is a fact of its catalog row
(:mod:`engine.schedule.catalog`), and :mod:`streams` turns any of them into the runtime's
action stream (communication, updates, the cut at N micro-batches) without knowing which
family it runs. Each function here is one order, named for what it does, not for a family:

* :func:`one_at_a_time` (naive): F(n) B(n), micro-batch after micro-batch;
* :func:`fill_drain` (GPipe): every forward of the mini-batch, then every backward;
* :func:`one_f_one_b` (PipeDream-Flush): S-1-s warm-up forwards, one forward one backward,
  the cool-down backwards; flushed every mini-batch;
* :func:`zero_bubble_h1` (ZB-H1): one_f_one_b's order with the backward split into B and a
  W deferred by s backwards;
* :func:`steady_1f1b` (PipeDream, 2BW, pb in 1f1b order): the same alternation never flushed;
* :func:`dataflow` (pb, Kosson et al.): at tick t stage s runs F(t-s) and B(t-2(S-1)+s).

Every order yields ``(action, tick)`` for ever: the dataflow tick, or -1 in the orders that
have none. Micro-batches are numbered from 0; a flushed order repeats its mini-batch pattern
(mini-batch j covers j*M .. (j+1)*M-1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from engine.schedule.ir import Action, Kind

__all__ = [
    "Compute",
    "dataflow",
    "fill_drain",
    "one_at_a_time",
    "one_f_one_b",
    "steady_1f1b",
    "zero_bubble_h1",
]

#: ``compute(stage, stages, chunks)``: the stage's open-ended (action, tick) pairs
Compute = Callable[[int, int, int], Iterator[tuple[Action, int]]]


def _flushed(block: Callable[[int, int, int, int], Iterator[Action]]) -> Compute:
    """An order that repeats ``block(s, S, base, M)`` mini-batch after mini-batch."""

    def compute(s: int, S: int, M: int) -> Iterator[tuple[Action, int]]:
        j = 0
        while True:
            for a in block(s, S, j * M, M):
                yield a, -1
            j += 1

    compute.__doc__ = block.__doc__
    compute.__name__ = block.__name__
    return compute


@_flushed
def one_at_a_time(s: int, S: int, base: int, M: int) -> Iterator[Action]:
    """Model parallel: the forward and backward of one micro-batch before the next."""
    for n in range(base, base + M):
        yield Action.forward(n)
        yield Action.backward(n)


@_flushed
def fill_drain(s: int, S: int, base: int, M: int) -> Iterator[Action]:
    """Every forward of the mini-batch, then every backward (GPipe)."""
    for n in range(base, base + M):
        yield Action.forward(n)
    for n in range(base, base + M):
        yield Action.backward(n)


def _one_f_one_b(s: int, S: int, base: int, M: int) -> Iterator[Action]:
    warm = min(S - 1 - s, M)
    for n in range(base, base + warm):
        yield Action.forward(n)
    for i in range(M - warm):
        yield Action.forward(base + warm + i)
        yield Action.backward(base + i)
    for n in range(base + M - warm, base + M):
        yield Action.backward(n)


one_f_one_b = _flushed(_one_f_one_b)
one_f_one_b.__doc__ = "S-1-s warm-up forwards, one forward one backward, then the drain."


@_flushed
def zero_bubble_h1(s: int, S: int, base: int, M: int) -> Iterator[Action]:
    """ZB-H1 (Qi et al. 2023) for one mini-batch: 1f1b's F/B order, B computing only the
    input gradient, and stage s deferring its weight gradients by s backwards (the W of the
    oldest waiting one after every later B) so the deferred Ws fill the cool-down bubble,
    which grows towards the last stage; the rest run before the update. This is the order
    torch.distributed.pipelining's zero-bubble ops take with one stage per rank."""
    waiting: list[int] = []
    for a in _one_f_one_b(s, S, base, M):
        yield a
        if a.kind is Kind.BACKWARD:
            waiting.append(a.mb)
            if len(waiting) > s:
                yield Action.weight(waiting.pop(0))
    for n in waiting:
        yield Action.weight(n)


def steady_1f1b(s: int, S: int, M: int) -> Iterator[tuple[Action, int]]:
    """PipeDream's steady 1F1B, never flushed: S-1-s warm-up forwards, then F, B alternate."""
    warm = S - 1 - s
    for n in range(warm):
        yield Action.forward(n), -1
    j = 0
    while True:
        yield Action.forward(warm + j), -1
        yield Action.backward(j), -1
        j += 1


def dataflow(s: int, S: int, M: int) -> Iterator[tuple[Action, int]]:
    """Kosson et al.'s ticks: at tick t stage s runs F(t-s) and B(t-2(S-1)+s)."""
    t = 0
    while True:
        if t - s >= 0:
            yield Action.forward(t - s), t
        b = t - 2 * (S - 1) + s
        if b >= 0:
            yield Action.backward(b), t
        t += 1
