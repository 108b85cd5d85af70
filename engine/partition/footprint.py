"""What each stage holds under each schedule: weight versions and micro-batches of activations.

Why this is its own file: it is a property of the **schedules**, not of the solver: the
counts are the rows of the schedule catalog (:mod:`engine.schedule.catalog`, which the
validator reads too), turned into the per-stage pairs the cost model takes. It needs neither
torch nor the rest of the package.

What a stage holds depends on the **schedule** and on the stage's **position**: PipeDream
stashes S-s weight versions at stage s, 2BW keeps two, GPipe keeps the activations of all M
micro-batches while 1F1B keeps at most S-s, and pipelined backprop (dataflow order) keeps
2(S-1-s)+1. A partitioner that ignores this puts too many layers on stage 0 and runs out of
memory exactly where it matters. :func:`stage_footprint` gives these counts; they are the
steady-state values of ALGORITHMS.md, and ``tests/partition/test_partition.py`` checks them against
:func:`engine.schedule.analyze`, which measures them by simulating the generated schedules.
For the asynchronous schedules (pipedream, 2bw, pb) the pipeline stays full across
mini-batches, so the count does not shrink with small M (PipeDream keeps S-s micro-batches
and versions in flight even with M = 1); the synchronous ones flush every mini-batch, so
1F1B holds min(M, S-s) and GPipe M.
"""

from __future__ import annotations

from engine.schedule.catalog import SCHEDULES, family

__all__ = ["SCHEDULES", "stage_footprint"]


def stage_footprint(
    schedule: str, stages: int, chunks: int, *, order: str | None = None
) -> list[tuple[int, int]]:
    """``(weight versions, micro-batches of activations)`` each stage holds at its peak.

    Steady-state values of ALGORITHMS.md (S stages, stage s, M = ``chunks``), read from the
    schedule catalog (:mod:`engine.schedule.catalog`), the one place that states them:

    ========== ============== ========================
    schedule   versions       activations held
    ========== ============== ========================
    naive      1              1
    gpipe      1              M
    1f1b       1              min(M, S-s)
    pipedream  S-s            S-s (async: never drains)
    2bw        2              S-s (needs M >= S)
    pb         1              2(S-1-s)+1 (dataflow), S-s (``order="1f1b"``)
    zbh1       1              min(M, S)
    zbv        1              min(M, S-s) (S = 2R stages as a V)
    vhalf      1              min(M, 2((R+2)//2)): the rank's peak
    vmin       1              min(M, 2((R+4)//3)): the rank's peak
    ========== ============== ========================

    A family whose row states no per-stage bound (interleaved) is refused.
    """
    fam = family(schedule)
    order = fam.check_order(order)
    fam.check(stages, chunks, None)
    out = []
    for s in range(stages):
        held = fam.activation_bound(stages, s, chunks, order)
        if held is None:
            raise ValueError(
                f"schedule {schedule!r} states no per-stage activation bound to partition "
                "under; partition for a family that does (e.g. '1f1b') and run it with these "
                "layer counts"
            )
        out.append((fam.weight_versions(stages, s), held))
    return out
