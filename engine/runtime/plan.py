"""Per-stage action streams of every schedule, and the delays they imply.

Why the runtime generates its own streams instead of only reading ``engine.schedule``'s
finite lists: asynchronous schedules never end. A stage's work is an infinite stream of
F(i) / B(i) / U actions over micro-batch indices i counted from the last flush; ``step()``
feeds inputs and runs every stream until it blocks on a missing input, and ``flush()`` filters
the stream to the micro-batches that exist and runs it dry. Only the *order of actions within
a stage* decides which weights a micro-batch sees (updates of stage s touch only stage s), so
pausing at any point between calls never changes the results.

D_s is derived by running the same streams symbolically (``derive_delays``) -- never typed in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

__all__ = [
    "Act",
    "SYNC_SCHEDULES",
    "ASYNC_SCHEDULES",
    "SCHEDULES",
    "stage_stream",
    "derive_delays",
    "spectrain_horizons",
]

SYNC_SCHEDULES = ("naive", "gpipe", "1f1b")
ASYNC_SCHEDULES = ("pipedream", "2bw", "pb")
SCHEDULES = SYNC_SCHEDULES + ASYNC_SCHEDULES


@dataclasses.dataclass(frozen=True)
class Act:
    """One action of a stage: ``kind`` is "F", "B" or "U"; ``i`` the micro-batch index
    (segment-relative) for F and B, -1 for U."""

    kind: str
    i: int = -1

    def __str__(self) -> str:
        return "U" if self.kind == "U" else f"{self.kind}{self.i}"


def _sync(schedule: str, s: int, S: int, M: int) -> Iterator[Act]:
    """The F/B actions of one synchronous mini-batch; the pipeline updates after all of them."""
    if schedule == "naive":
        for i in range(M):
            yield Act("F", i)
            yield Act("B", i)
    elif schedule == "gpipe":
        for i in range(M):
            yield Act("F", i)
        for i in range(M):
            yield Act("B", i)
    elif schedule == "1f1b":
        warm = min(S - 1 - s, M)
        for i in range(warm):
            yield Act("F", i)
        for j in range(M - warm):
            yield Act("F", warm + j)
            yield Act("B", j)
        for j in range(M - warm, M):
            yield Act("B", j)
    else:  # pragma: no cover - validated by the pipeline
        raise ValueError(schedule)


def _async_1f1b(s: int, S: int, k: int) -> Iterator[Act]:
    """PipeDream's steady 1F1B: S-1-s warm-up forwards, then F(w+j), B(j), update every k Bs."""
    warm = S - 1 - s
    for i in range(warm):
        yield Act("F", i)
    j = 0
    while True:
        yield Act("F", warm + j)
        yield Act("B", j)
        if (j + 1) % k == 0:
            yield Act("U")
        j += 1


def _dataflow(s: int, S: int, k: int) -> Iterator[Act]:
    """Kosson et al.'s fine-grained pipeline: at tick t stage s runs F(t-s), B(t-2(S-1)+s),
    then its update after every k-th backward."""
    t = 0
    nb = 0
    while True:
        if t - s >= 0:
            yield Act("F", t - s)
        b = t - 2 * (S - 1) + s
        if b >= 0:
            yield Act("B", b)
            nb += 1
            if nb % k == 0:
                yield Act("U")
        t += 1


def stage_stream(
    schedule: str, s: int, S: int, M: int, k: int, order: str | None = None
) -> Iterator[Act]:
    """The action stream of stage ``s``: finite (one mini-batch, no U) for the synchronous
    schedules, infinite (with U) for the asynchronous ones."""
    if schedule in SYNC_SCHEDULES:
        return _sync(schedule, s, S, M)
    if schedule in ("pipedream", "2bw") or (schedule == "pb" and order == "1f1b"):
        return _async_1f1b(s, S, k)
    if schedule == "pb":
        return _dataflow(s, S, k)
    raise ValueError(schedule)  # pragma: no cover


def spectrain_horizons(s: int, S: int) -> tuple[int, int]:
    """SpecTrain's (s_F, s_B) for stage s of S (paper version; stage index plays GPU k)."""
    return s // 2 + S - s - 1, s // 2


def derive_delays(
    schedule: str,
    S: int,
    M: int,
    k: int,
    order: str | None,
    forward_version: Callable[[int, int, int], int] | None = None,
    horizon: int | None = None,
) -> tuple[list[int], list[list[int]]]:
    """D_s of every stage by symbolic execution of the streams.

    Runs each stage's stream over ``horizon`` micro-batches counting updates; the delay of a
    micro-batch is (index of the update that consumes its gradient) - (version its forward
    read). ``forward_version(s, i, updates_so_far)`` overrides the version a forward reads
    (2BW reads a prescribed older version). Returns (D_s per stage, steady-state delays per
    stage). D_s is the rounded mean over the steady state (every micro-batch in the middle
    half of the horizon), which is the exact constant whenever the delay is constant
    (k = 1, or k dividing the pipeline depth) and PipeMare's ``about 2(S-1-s)/k`` otherwise.
    """
    if schedule in SYNC_SCHEDULES:
        return [0] * S, [[0] for _ in range(S)]
    n = horizon or max(8 * (S + k + M), 64)
    delays: list[int] = []
    steady: list[list[int]] = []
    for s in range(S):
        updates = 0
        t_f: dict[int, int] = {}
        group: list[int] = []
        got: dict[int, int] = {}
        for act in stage_stream(schedule, s, S, M, k, order):
            if act.kind == "F":
                t_f[act.i] = (
                    updates if forward_version is None else forward_version(s, act.i, updates)
                )
            elif act.kind == "B":
                group.append(act.i)
            else:
                for i in group:
                    got[i] = updates - t_f[i]
                group = []
                updates += 1
                if updates * k > n:
                    break
        lo, hi = n // 4, (3 * n) // 4
        mid = [got[i] for i in sorted(got) if lo <= i < hi]
        steady.append(mid)
        delays.append(int(sum(mid) / len(mid) + 0.5) if mid else 0)
    return delays, steady
