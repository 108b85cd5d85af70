"""Open-ended per-stage action streams: the one definition of what every stage runs, in order.

Why streams and not only finite lists: asynchronous schedules (pipedream, 2bw, pb) never
flush, so what a stage runs over a whole training run is an unbounded sequence. The runtime
(every transport: in-process, gloo, NCCL) pulls actions from :func:`stage_actions` one at a
time; :func:`engine.schedule.generate` is the same stream cut at T*M micro-batches, so what
the validator proves and the analysis measures is exactly what executes.

A stream yields :class:`~engine.schedule.ir.Action` s, communication included (RF before a
forward on s > 0, SF after it on s < S-1, RB before a backward on s < S-1, SB after it on
s > 0), and an update ``U`` after every k-th backward (weight gradient ``W`` when the family
splits the backward) naming the micro-batches it applies.
Micro-batches are numbered from 0 at the start of the stream (the runtime restarts the
stream after a flush). Synchronous schedules repeat their mini-batch pattern forever, one
``U`` (k = M) closing each mini-batch.

Cutting a stream at N micro-batches (:func:`truncate`) keeps the actions whose micro-batch
is < N and every update whose micro-batches are all < N; the generators require k | N, so no
update straddles the cut.
"""

from __future__ import annotations

from collections.abc import Iterator

from engine.schedule.catalog import family
from engine.schedule.ir import Action, Kind

__all__ = ["stage_actions", "stage_ticks", "truncate", "truncate_ticks"]


def _with_comms(stage: int, S: int, a: Action) -> Iterator[Action]:
    """The action wrapped in the receive before it and the send after it."""
    if a.kind is Kind.FORWARD:
        if stage > 0:
            yield Action.recv_act(a.mb)
        yield a
        if stage < S - 1:
            yield Action.send_act(a.mb)
    elif a.kind is Kind.BACKWARD:
        if stage < S - 1:
            yield Action.recv_grad(a.mb)
        yield a
        if stage > 0:
            yield Action.send_grad(a.mb)
    else:
        yield a


def _zbh1(s: int, S: int, base: int, M: int) -> Iterator[Action]:
    """ZB-H1 (Qi et al. 2023) for one mini-batch: 1f1b's F/B order, B computing only the
    input gradient, and stage s deferring its weight gradients by s backwards (the W of the
    oldest waiting one after every later B) so the deferred Ws fill the cool-down bubble,
    which grows towards the last stage; the rest run before the update. This is the order
    torch.distributed.pipelining's zero-bubble ops take with one stage per rank."""
    warm = min(S - 1 - s, M)
    waiting: list[int] = []

    def backward(n: int) -> Iterator[Action]:
        yield Action.backward(n)
        waiting.append(n)
        if len(waiting) > s:
            yield Action.weight(waiting.pop(0))

    for n in range(base, base + warm):
        yield Action.forward(n)
    for i in range(M - warm):
        yield Action.forward(base + warm + i)
        yield from backward(base + i)
    for n in range(base + M - warm, base + M):
        yield from backward(n)
    for n in waiting:
        yield Action.weight(n)


def _compute(name: str, order: str, s: int, S: int, M: int) -> Iterator[tuple[Action, int]]:
    """F and B of stage s as (action, dataflow tick or -1), without updates or comms."""
    if order == "dataflow":
        t = 0
        while True:
            if t - s >= 0:
                yield Action.forward(t - s), t
            b = t - 2 * (S - 1) + s
            if b >= 0:
                yield Action.backward(b), t
            t += 1
    if family(name).synchronous:
        j = 0
        while True:  # mini-batch j covers micro-batches j*M .. (j+1)*M-1
            base = j * M
            if name == "naive":
                for n in range(base, base + M):
                    yield Action.forward(n), -1
                    yield Action.backward(n), -1
            elif name == "gpipe":
                for n in range(base, base + M):
                    yield Action.forward(n), -1
                for n in range(base, base + M):
                    yield Action.backward(n), -1
            elif name == "zbh1":
                yield from ((a, -1) for a in _zbh1(s, S, base, M))
            else:  # 1f1b, flushed every mini-batch
                warm = min(S - 1 - s, M)
                for n in range(base, base + warm):
                    yield Action.forward(n), -1
                for i in range(M - warm):
                    yield Action.forward(base + warm + i), -1
                    yield Action.backward(base + i), -1
                for n in range(base + M - warm, base + M):
                    yield Action.backward(n), -1
            j += 1
    # pipedream, 2bw, pb in 1f1b order: PipeDream's steady 1F1B, never flushed
    warm = S - 1 - s
    for n in range(warm):
        yield Action.forward(n), -1
    j = 0
    while True:
        yield Action.forward(warm + j), -1
        yield Action.backward(j), -1
        j += 1


def _stream(
    name: str, stage: int, stages: int, chunks: int, update_size: int | None, order: str | None
) -> Iterator[tuple[Action, int]]:
    """(action, tick) pairs; tick is the dataflow tick, or -1 outside the dataflow order."""
    fam = family(name)
    order = fam.check_order(order)
    k = fam.check(stages, chunks, update_size, check_chunks=False)
    if not (isinstance(stage, int) and 0 <= stage < stages):
        raise ValueError(f"stage {stage} does not exist in a pipeline of {stages} stages")
    done: list[int] = []
    for a, tick in _compute(name, order, stage, stages, chunks):
        for c in _with_comms(stage, stages, a):
            yield c, tick
        if a.kind is (Kind.WEIGHT if fam.split_backward else Kind.BACKWARD):
            done.append(a.mb)
            if len(done) == k:
                yield Action.update(done), tick
                done = []


def stage_actions(
    name: str,
    stage: int,
    stages: int,
    chunks: int,
    update_size: int | None = None,
    order: str | None = None,
) -> Iterator[Action]:
    """The unbounded action stream of ``stage`` for schedule ``name`` (see the module docs).

    Args:
        name: one of ``naive``, ``gpipe``, ``1f1b``, ``pipedream``, ``2bw``, ``pb``.
        stage: s, 0 <= s < ``stages``.
        stages: S.
        chunks: M, micro-batches per mini-batch.
        update_size: k (default M for synchronous schedules and 2bw, 1 for pipedream/pb).
        order: only for pb: ``"dataflow"`` (default) or ``"1f1b"``.

    The stream never ends; cut it with :func:`truncate` or stop pulling.
    """
    for a, _ in _stream(name, stage, stages, chunks, update_size, order):
        yield a


def stage_ticks(
    name: str,
    stage: int,
    stages: int,
    chunks: int,
    update_size: int | None = None,
    order: str | None = None,
) -> Iterator[tuple[Action, int]]:
    """Like :func:`stage_actions`, with the dataflow tick of each action (-1 in other orders)."""
    return _stream(name, stage, stages, chunks, update_size, order)


def truncate(stream: Iterator[Action], N: int) -> Iterator[Action]:
    """Cut an unbounded stream at N micro-batches: keep actions on micro-batches < N and
    updates whose micro-batches are all < N; stop after the update (and sends) following the
    N-th backward.

    Callers must make k divide N (the generators check it); a trailing partial group of
    gradients is not an update of this stream.
    """
    for a, _ in truncate_ticks(((a, -1) for a in stream), N):
        yield a


def truncate_ticks(pairs: Iterator[tuple[Action, int]], N: int) -> Iterator[tuple[Action, int]]:
    """:func:`truncate` over (action, tick) pairs, as :func:`stage_ticks` yields them."""
    backwards = 0
    for a, t in pairs:
        if a.kind is Kind.UPDATE:
            if a.mbs[-1] < N:
                yield a, t
            if backwards >= N:
                return
            continue
        if a.mb >= N:
            if backwards >= N:
                return
            continue
        yield a, t
        if a.kind is Kind.BACKWARD:
            backwards += 1
