"""Generators: the schedules of ALGORITHMS.md as :class:`Schedule` data.

Why generators emit complete data (compute, updates, sends and receives, ticks): the runtime
must not re-decide anything -- what it executes is what the validator checked and what the
analysis measured the delays of.

Conventions shared by all generators:

* Micro-batches are numbered globally 0 .. T*M-1 across the T mini-batches (``steps``); the
  2BW version rule max(floor(n/M) - 1, 0) uses this numbering.
* Backwards on a stage run in micro-batch order, so an update always applies a contiguous
  range ``U a-b``. A stage's update follows the backward that completes its group of k.
* Synchronous schedules (naive, gpipe, 1f1b) update once per mini-batch (k = M) and flush
  every mini-batch. Asynchronous ones (pipedream, 2bw, pb) never flush between mini-batches:
  one fill, steady state, and a single drain at the end of the T mini-batches.
* Every F(n) on s > 0 is preceded by RF(n), every F(n) on s < S-1 followed by SF(n); every
  B(n) on s < S-1 is preceded by RB(n), every B(n) on s > 0 followed by SB(n).
"""

from __future__ import annotations

from dataclasses import replace

from engine._checks import check_positive_int
from engine.schedule.catalog import SCHEDULES, family
from engine.schedule.ir import Action, Schedule
from engine.schedule.simulate import unit_ticks
from engine.schedule.streams import stage_ticks, truncate_ticks

__all__ = ["SCHEDULES", "generate"]


def generate(
    name: str,
    stages: int,
    chunks: int,
    steps: int = 1,
    update_size: int | None = None,
    order: str | None = None,
) -> Schedule:
    """Build the schedule ``name`` for S = ``stages``, M = ``chunks``, T = ``steps`` mini-batches.

    A rank-program family (interleaved, zbv, vhalf, vmin, dualpipev, looped_bfs) is built
    over ``stages`` stage modules by its catalog row: the V families on S/2 ranks, the
    round-robin ones with v = 2 stages per rank.

    Args:
        name: a family of the catalog (:data:`engine.schedule.catalog.NAMES`).
        stages: S >= 1 pipeline stages.
        chunks: M >= 1 micro-batches per mini-batch (2bw needs M >= S).
        steps: T >= 1 mini-batches; async schedules run them without flushing in between.
        update_size: k, micro-batches per update. Synchronous schedules and 2bw update once
            per mini-batch (k = M, the default); pipedream and pb default to k = 1. k must
            divide T*M so the final drain applies a full update.
        order: only for pb: ``"dataflow"`` (default; Kosson et al.'s ticks) or ``"1f1b"``.
    """
    fam = family(name)
    if fam.is_program:
        S = check_positive_int("stages", stages, "a pipeline needs at least one stage")
        return fam.program_for(
            S, chunks, steps=steps, update_size=update_size, order=order,
            virtual_stages=2 if fam.takes_virtual_stages else None,
        )
    S = check_positive_int("stages", stages, "a pipeline needs at least one stage")
    M = check_positive_int("chunks", chunks, "a mini-batch needs at least one micro-batch")
    T = check_positive_int("steps", steps, "cover at least one mini-batch")
    N = M * T
    order = fam.check_order(order)
    k = fam.check(S, M, update_size)
    if N % k:
        raise ValueError(
            f"update_size k={k} must divide the number of micro-batches steps*chunks = {N} so "
            f"every gradient is applied by a full update; choose k among "
            f"{[d for d in range(1, N + 1) if N % d == 0]} or change steps"
        )

    # the finite schedule is the open-ended stream of every stage cut at N micro-batches
    actions: list[list[Action]] = []
    ticks: list[list[int]] | None = [] if order == "dataflow" else None
    for s in range(S):
        pairs = list(truncate_ticks(stage_ticks(name, s, S, M, k, order), N))
        actions.append([a for a, _ in pairs])
        if ticks is not None:
            ticks.append([t for _, t in pairs])
    schedule = Schedule(
        name=name,
        stages=S,
        chunks=M,
        steps=T,
        update_size=k,
        order=order,
        weights=fam.weights,
        actions=tuple(tuple(a) for a in actions),
        ticks=None if ticks is None else tuple(tuple(t) for t in ticks),
    )
    if schedule.ticks is None:
        schedule = replace(schedule, ticks=unit_ticks(schedule))
    return schedule
