"""The exact solver: split n layers into S contiguous stages, optimally, under a memory cap.

Why this is its own file: the algorithm (three dynamic programs and the message that explains
an infeasible cap) is independent of how costs were obtained and of torch; it works on the
integer model of :mod:`engine.partition.costs` and nothing else.

The solver is exact, not greedy (see :func:`partition`): dynamic programming over prefix
sums, O(S * n^2) for n layers and S stages. Because the cost model is in exact integers (see
:mod:`engine.partition.costs`), comparisons never depend on floating-point summation order,
and a brute force over all splits finds exactly the same answer (the tests check this).

Tie-break (deterministic): among the splits that minimise the objective, take the one that
minimises the other quantity's maximum (``"time"``: the least peak stage memory;
``"memory"``: the least bottleneck time); among those, the lexicographically smallest balance,
i.e. the fewest layers on the earliest stages, which under 1F1B/PipeDream/pb are the stages
that hold the most versions and activations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction

from engine._checks import check_positive_int
from engine.partition.costs import (
    LayerCost,
    StageCost,
    _check_costs,
    _fmt_bytes,
    _fmt_factor,
    _Model,
    _optimizer_factor,
)
from engine.partition.footprint import stage_footprint
from engine.schedule.catalog import family

__all__ = ["OBJECTIVES", "partition"]

OBJECTIVES: tuple[str, ...] = ("time", "memory")

_Cost = Callable[[int, int, int], int]
_Allowed = Callable[[int, int, int], bool]


def _minmax(n: int, S: int, cost: _Cost, allowed: _Allowed) -> int | None:
    """min over splits of [0, n) into S non-empty contiguous stages of max_s cost(s, i, j),
    among splits whose every stage is ``allowed``; None when no split is allowed.

    best[j] after round s = optimum for layers [0, j) on stages 0..s. O(S n^2).
    """
    prev: list[int | None] = [None] * (n + 1)
    prev[0] = -1  # sentinel below every cost (costs are >= 0)
    for s in range(S):
        cur: list[int | None] = [None] * (n + 1)
        # stage s ends at j in [s+1, n-(S-1-s)], starts at i in [s, j-1]
        for j in range(s + 1, n - (S - 1 - s) + 1):
            best: int | None = None
            for i in range(s, j):
                p = prev[i]
                if p is None or not allowed(s, i, j):
                    continue
                c = cost(s, i, j)
                v = p if p > c else c
                if best is None or v < best:
                    best = v
            cur[j] = best
        prev = cur
    return prev[n]


def _lex_first(n: int, S: int, allowed: _Allowed) -> list[int] | None:
    """The lexicographically smallest balance whose every stage is ``allowed``. O(S n^2)."""
    # ok[s][i]: layers [i, n) can be split over stages s..S-1
    ok = [[False] * (n + 1) for _ in range(S + 1)]
    ok[S][n] = True
    for s in range(S - 1, -1, -1):
        for i in range(s, n - (S - s) + 1):
            ok[s][i] = any(
                ok[s + 1][j] and allowed(s, i, j) for j in range(i + 1, n - (S - 1 - s) + 1)
            )
    if not ok[0][0]:
        return None
    balance, i = [], 0
    for s in range(S):
        j = next(j for j in range(i + 1, n + 1) if ok[s + 1][j] and allowed(s, i, j))
        balance.append(j - i)
        i = j
    return balance


def _solve(
    model: _Model, n: int, S: int, primary: _Cost, secondary: _Cost, cap: int | None
) -> list[int] | None:
    """Minimise max primary, then max secondary, then the balance lexicographically."""

    def fits(s: int, i: int, j: int) -> bool:
        return cap is None or model.memory(s, i, j) <= cap

    b1 = _minmax(n, S, primary, fits)
    if b1 is None:
        return None

    def within1(s: int, i: int, j: int) -> bool:
        return fits(s, i, j) and primary(s, i, j) <= b1

    b2 = _minmax(n, S, secondary, within1)
    assert b2 is not None  # the split that reached b1 is allowed here

    def within2(s: int, i: int, j: int) -> bool:
        return within1(s, i, j) and secondary(s, i, j) <= b2

    balance = _lex_first(n, S, within2)
    assert balance is not None
    return balance


def _check_cap(cap: object) -> int | None:
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float)):
        raise TypeError(f"memory_cap_bytes must be a number of bytes or None, got {cap!r}")
    if cap != cap:
        raise ValueError("memory_cap_bytes is NaN; give a number of bytes or None")
    if cap == math.inf:
        return None
    if cap < 0:
        raise ValueError(f"memory_cap_bytes must be >= 0, got {cap!r}")
    return math.floor(cap)  # memory is counted in whole bytes


def partition(
    costs: Sequence[LayerCost],
    stages: int,
    *,
    objective: str = "time",
    schedule: str = "1f1b",
    chunks: int,
    memory_cap_bytes: float | None = None,
    optimizer_state_factor: float | str = 2,
    order: str | None = None,
) -> list[int]:
    """Split ``costs`` (one per layer, in order) into ``stages`` contiguous stages, optimally.

    Args:
        costs: per-layer costs, e.g. from :func:`profile_layers`.
        stages: S, 1 <= S <= number of layers.
        objective: ``"time"`` minimises the slowest stage's forward + backward time;
            ``"memory"`` minimises the largest stage memory.
        schedule: one of :data:`SCHEDULES`; decides the weight versions and activations each
            stage holds (:func:`stage_footprint`). ``order`` picks pb's order.
        chunks: M, micro-batches per mini-batch.
        memory_cap_bytes: every stage's memory (see :mod:`engine.partition.costs`) must be <= this.
        optimizer_state_factor: optimizer buffers per parameter (SGD 0, momentum 1, Adam 2),
            a number or one of :data:`OPTIMIZER_STATE_FACTORS`' names.

    Returns:
        layer counts per stage, each >= 1, summing to ``len(costs)``.

    Algorithm: three exact dynamic programs over prefix sums, each O(S n^2): the minimal
    bottleneck of the objective under the cap; the minimal bottleneck of the other quantity
    given that; the lexicographically smallest balance given both (see the module docstring).

    Raises:
        ValueError: stages out of range, unknown objective/schedule, or no split fits the cap
            (the message gives the smallest cap that fits and the stage that needs it).
    """
    layers = _check_costs(costs)
    n = len(layers)
    S = check_positive_int("stages", stages, "a pipeline needs at least one stage")
    if S > n:
        raise ValueError(
            f"cannot split {n} layer{'s' if n != 1 else ''} into {S} stages; use at most {n} "
            f"stage{'s' if n != 1 else ''} or split layers"
        )
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; use 'time' or 'memory'")
    footprint = stage_footprint(schedule, S, chunks, order=order)
    factor = _optimizer_factor(optimizer_state_factor)
    cap = _check_cap(memory_cap_bytes)
    model = _Model(layers, footprint, factor)
    if objective == "time":
        primary, secondary = model.time, model.memory
    else:
        primary, secondary = model.memory, model.time
    balance = _solve(model, n, S, primary, secondary, cap)
    if balance is None:
        raise ValueError(
            _infeasible_message(model, n, S, cap, schedule, chunks, order, factor, memory_cap_bytes)
        )
    return balance


def _infeasible_message(
    model: _Model,
    n: int,
    S: int,
    cap: int | None,
    schedule: str,
    chunks: int,
    order: str | None,
    factor: Fraction,
    cap_given: object,
) -> str:
    def anything(s: int, i: int, j: int) -> bool:
        return True

    need = _minmax(n, S, model.memory, anything)
    assert need is not None and cap is not None and need > cap
    witness = _solve(model, n, S, model.memory, model.time, None)
    assert witness is not None
    stages: list[StageCost] = []
    i = 0
    for s, k in enumerate(witness):
        stages.append(model.stage(s, i, i + k))
        i += k
    worst = next(st for st in stages if st.memory_bytes == need)
    sched = f"schedule {schedule!r}" + (f" (order {order!r})" if order else "")
    lines = [
        f"no split of {n} layers into {S} stages fits memory_cap_bytes={cap_given!r} under "
        f"{sched} with chunks={chunks} and optimizer_state_factor={_fmt_factor(factor)}: "
        f"the smallest cap that fits is {need} bytes ({_fmt_bytes(need)}), reached by "
        f"balance {witness}, whose tightest stage is {worst.describe(factor)}."
    ]
    fixes = [f"raise memory_cap_bytes to at least {need}"]
    if S < n:
        fixes.append("use more stages")
    if len(worst.layers) == 1:
        fixes.append(f"split layer {worst.layers[0]} (it is alone on stage {worst.stage})")
    fam, lean = family(schedule), family("1f1b")  # 1f1b: one live version, S - s activations
    held = fam.activation_bound(S, worst.stage, chunks, order)
    if fam.weights == "stash" or held > lean.activation_bound(S, worst.stage, chunks, None):
        fixes.append("use a schedule that holds fewer versions or activations (e.g. '1f1b')")
    elif held > 1 and worst.activation_bytes:
        fixes.append("use activation checkpointing or smaller micro-batches")
    lines.append("Fix: " + "; or ".join(fixes) + ".")
    return " ".join(lines)
