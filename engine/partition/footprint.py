"""What each stage holds under each schedule: weight versions and micro-batches of activations.

Why this is its own file: it is a property of the **schedules**, not of the solver. It changes
when a schedule is added or its memory behaviour changes, and it is meant to move into one
schedule catalog (with ``engine.schedule``'s names and ``validate``'s activation bound) without
taking the cost model or the solver along. It needs neither torch nor the rest of the package.

What a stage holds depends on the **schedule** and on the stage's **position**: PipeDream
stashes S-s weight versions at stage s, 2BW keeps two, GPipe keeps the activations of all M
micro-batches while 1F1B keeps at most S-s, and pipelined backprop (dataflow order) keeps
2(S-1-s)+1. A partitioner that ignores this puts too many layers on stage 0 and runs out of
memory exactly where it matters. :func:`stage_footprint` gives these counts; they are the
steady-state values of ALGORITHMS.md, and ``tests/test_partition.py`` checks them against
:func:`engine.schedule.analyze`, which measures them by simulating the generated schedules.
For the asynchronous schedules (pipedream, 2bw, pb) the pipeline stays full across
mini-batches, so the count does not shrink with small M (PipeDream keeps S-s micro-batches
and versions in flight even with M = 1); the synchronous ones flush every mini-batch, so
1F1B holds min(M, S-s) and GPipe M.
"""

from __future__ import annotations

from engine._checks import check_positive_int

__all__ = ["SCHEDULES", "stage_footprint"]

#: schedules whose per-stage footprint is known (the names of :data:`engine.schedule.SCHEDULES`)
SCHEDULES: tuple[str, ...] = ("naive", "gpipe", "1f1b", "pipedream", "2bw", "pb")


def _check_schedule(schedule: object, order: str | None) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; known schedules: {', '.join(SCHEDULES)}")
    assert isinstance(schedule, str)
    if order is not None:
        if schedule != "pb":
            raise ValueError(
                f"order={order!r} only applies to schedule 'pb' ('dataflow' or '1f1b'); "
                f"leave order unset for {schedule!r}"
            )
        if order not in ("dataflow", "1f1b"):
            raise ValueError(f"unknown pb order {order!r}; use 'dataflow' or '1f1b'")
    return schedule


def stage_footprint(
    schedule: str, stages: int, chunks: int, *, order: str | None = None
) -> list[tuple[int, int]]:
    """``(weight versions, micro-batches of activations)`` each stage holds at its peak.

    Steady-state values of ALGORITHMS.md (S stages, stage s, M = ``chunks``):

    ========== ============== ========================
    schedule   versions       activations held
    ========== ============== ========================
    naive      1              1
    gpipe      1              M
    1f1b       1              min(M, S-s)
    pipedream  S-s            S-s (async: never drains)
    2bw        2              S-s (needs M >= S)
    pb         1              2(S-1-s)+1 (dataflow), S-s (``order="1f1b"``)
    ========== ============== ========================
    """
    _check_schedule(schedule, order)
    S = check_positive_int("stages", stages, "a pipeline needs at least one stage")
    M = check_positive_int("chunks", chunks, "a mini-batch needs at least one micro-batch")
    if schedule == "2bw" and M < S:
        raise ValueError(
            f"schedule '2bw' needs chunks M >= stages S so that two weight versions suffice; "
            f"got chunks={M} with {S} stages: use chunks >= {S}, or schedule 'pipedream'"
        )
    out: list[tuple[int, int]] = []
    for s in range(S):
        if schedule == "naive":
            out.append((1, 1))
        elif schedule == "gpipe":
            out.append((1, M))
        elif schedule == "1f1b":
            out.append((1, min(M, S - s)))
        elif schedule == "pipedream":
            out.append((S - s, S - s))
        elif schedule == "2bw":
            out.append((2, S - s))
        elif order == "1f1b":  # pb in 1F1B order: live weights, async 1F1B in flight
            out.append((1, S - s))
        else:  # pb dataflow
            out.append((1, 2 * (S - 1 - s) + 1))
    return out
