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
from engine.schedule.lower import with_comms

__all__ = ["stage_actions", "stage_ticks", "truncate", "truncate_ticks"]


def _stream(
    name: str, stage: int, stages: int, chunks: int, update_size: int | None, order: str | None
) -> Iterator[tuple[Action, int]]:
    """(action, tick) pairs; tick is the dataflow tick, or -1 outside the dataflow order."""
    fam = family(name)
    compute = fam.compute(order)
    k = fam.check(stages, chunks, update_size, check_chunks=False)
    if not (isinstance(stage, int) and 0 <= stage < stages):
        raise ValueError(f"stage {stage} does not exist in a pipeline of {stages} stages")
    done: list[int] = []
    for a, tick in compute(stage, stages, chunks):
        for c in with_comms(stage, stages, a):
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
        name: a stream family (``engine.schedule.SCHEDULES``: naive, gpipe, 1f1b, zbh1,
            pipedream, 2bw, pb); the rank-program families are finite programs instead.
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
