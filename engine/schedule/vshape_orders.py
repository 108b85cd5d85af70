"""ZB-V, DualPipeV and looped BFS, generated natively: each rank's order for one mini-batch.

Why these three: they are the multi-stage-per-rank schedules torch.distributed.pipelining
2.13 ships next to interleaved 1F1B (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``,
``ScheduleLoopedBFS``), so a program written for torchtitan or NeMo can be generated, checked
and run here. Each function states one rank's compute order for one mini-batch, rebuilt from
the papers' phase rules (tests compare the orders with torch's classes); :mod:`ranked` turns
the ranks' orders into a program (updates, communication, ticks). All three are synchronous:
each stage applies its M gradients once, at the end of the mini-batch.

* **ZB-V** (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6): R ranks, 2R stages
  placed as a V (rank r holds r and 2R-1-r), backward split into B (input gradient) and W
  (weight gradient). Rank r warms up with 2(R-r)-1 forwards of its first chunk, then r pairs of
  (second-chunk F, first-chunk F), then R-r rounds of (F, B, W) on the second chunk; the steady
  state runs (F, B, W) on the first chunk and then on the second; the cool-down runs r pairs
  of Bs, then R-r (B, W) on the first chunk, then the remaining Ws. With F = B = W in time the
  bubble is near zero while each rank holds about 1F1B's activations. Micro-batch counts below
  2R-1 run the 2R-1 pattern with the missing micro-batches left out.
* **DualPipeV** (DeepSeek-V3 report, DualPipe "cut in half"): the same V placement, M >= 2R.
  After a warm-up of forwards and zero-bubble (B, W, F) rounds, the main phase issues a forward
  of one chunk overlapped with a whole backward of the other (an *overlapped pair*, torch's
  ``OVERLAP_F_B``); the tail switches half-way to split backwards whose Ws fill the drain.
* **Looped BFS** (torch's breadth-first schedule): round-robin placement; rank r runs every
  forward of its first stage, then of its next, ..., then the backwards stage by stage in
  reverse, each stage's micro-batches from last to first.
"""

from __future__ import annotations

from engine._checks import check_positive_int
from engine.schedule.ir import Action, Kind, Schedule
from engine.schedule.ranked import Unit, build, loop_placement, v_placement

__all__ = ["zbv", "dualpipev", "looped_bfs", "zbv_rank_order", "dualpipev_rank_order",
           "looped_bfs_rank_order"]


def _one(stage: int, kind: Kind, mb: int) -> Unit:
    return ((stage, Action(kind, (mb,))),)


def zbv_rank_order(ranks: int, chunks: int, rank: int) -> list[Unit]:
    """Rank ``rank``'s ZB-V compute units for one mini-batch (module docstring)."""
    R, M, r = ranks, chunks, rank
    n = max(2 * R - 1, M)  # the pattern needs 2R-1 micro-batches; extra ones are left out
    c0, c1 = r, 2 * R - 1 - r
    nxt = {(c, k): 0 for c in (c0, c1) for k in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)}
    out: list[Unit] = []

    def op(c: int, k: Kind) -> None:
        out.append(_one(c, k, nxt[(c, k)]))
        nxt[(c, k)] += 1

    for _ in range(2 * (R - r) - 1):
        op(c0, Kind.FORWARD)
    for _ in range(r):
        op(c1, Kind.FORWARD)
        op(c0, Kind.FORWARD)
    for _ in range(R - r):
        op(c1, Kind.FORWARD)
        op(c1, Kind.BACKWARD)
        op(c1, Kind.WEIGHT)
    while nxt[(c1, Kind.FORWARD)] < nxt[(c0, Kind.FORWARD)] or nxt[(c0, Kind.FORWARD)] < n:
        if nxt[(c0, Kind.FORWARD)] < n:
            op(c0, Kind.FORWARD)
        op(c0, Kind.BACKWARD)
        op(c0, Kind.WEIGHT)
        op(c1, Kind.FORWARD)
        op(c1, Kind.BACKWARD)
        op(c1, Kind.WEIGHT)
    for _ in range(r):
        op(c0, Kind.BACKWARD)
        op(c1, Kind.BACKWARD)
    for _ in range(R - r):
        op(c0, Kind.BACKWARD)
        op(c0, Kind.WEIGHT)
    for c in (c1, c0):
        while nxt[(c, Kind.WEIGHT)] < nxt[(c, Kind.BACKWARD)]:
            op(c, Kind.WEIGHT)
    return [u for u in out if u[0][1].mb < M]


def dualpipev_rank_order(ranks: int, chunks: int, rank: int) -> list[Unit]:
    """Rank ``rank``'s DualPipeV compute units for one mini-batch (module docstring). A whole
    backward is ``B`` without a ``W``; a split one is ``B`` (input gradient) and a later ``W``,
    the Ws running oldest first whenever the order has room for one."""
    R, M, r = ranks, chunks, rank
    c0, c1 = r, 2 * R - 1 - r
    f = {c0: 0, c1: 0}
    b = {c0: 0, c1: 0}
    waiting: list[tuple[int, int]] = []  # split backwards whose W has not run, oldest first
    out: list[Unit] = []

    def fwd(c: int) -> tuple[int, Action]:
        f[c] += 1
        return (c, Action.forward(f[c] - 1))

    def bwd(c: int, split: bool) -> tuple[int, Action]:
        b[c] += 1
        if split:
            waiting.append((c, b[c] - 1))
        return (c, Action.backward(b[c] - 1))

    def weight() -> None:
        if waiting:
            c, m = waiting.pop(0)
            out.append(((c, Action.weight(m)),))

    for _ in range(2 * (R - r - 1)):
        out.append((fwd(c0),))
    for _ in range(r + 1):
        out.append((fwd(c0),))
        out.append((fwd(c1),))
    for _ in range(R - r - 1):
        out.append((bwd(c1, True),))
        weight()
        out.append((fwd(c1),))
    for i in range(M - 2 * R + r + 1):
        if i == 0 and r == R - 1:  # the last rank's first pair runs apart (smaller bubble)
            out.append((fwd(c0),))
            out.append((bwd(c1, False),))
        else:
            out.append((fwd(c0), bwd(c1, False)))
        out.append((fwd(c1), bwd(c0, False)))
    for _ in range(R - r - 1):
        out.append((bwd(c1, False),))
        out.append((fwd(c1), bwd(c0, False)))
    split = False
    for i in range(r + 1):  # half-way through, backwards start to split (Ws fill the drain)
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        out.append((bwd(c1, split),))
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        out.append((bwd(c0, split),))
    for _ in range(R - r - 1):
        weight()
        out.append((bwd(c0, split),))
    for _ in range(r + 1):
        weight()
    return out


def looped_bfs_rank_order(ranks: int, virtual: int, chunks: int, rank: int) -> list[Unit]:
    """Rank ``rank``'s looped-BFS compute units for one mini-batch (module docstring)."""
    mine = list(range(rank, ranks * virtual, ranks))
    out = [_one(s, Kind.FORWARD, m) for s in mine for m in range(chunks)]
    out += [_one(s, Kind.BACKWARD, m) for s in reversed(mine) for m in reversed(range(chunks))]
    return out


def _check(R: int, M: int, T: int) -> tuple[int, int, int]:
    R = check_positive_int("ranks", R, "a pipeline needs at least one rank")
    M = check_positive_int("chunks", M, "a mini-batch needs at least one micro-batch")
    T = check_positive_int("steps", T, "cover at least one mini-batch")
    return R, M, T


def zbv(ranks: int, chunks: int, steps: int = 1) -> Schedule:
    """ZB-V on R = ``ranks`` ranks (2R stages as a V), M = ``chunks``, T = ``steps``."""
    R, M, T = _check(ranks, chunks, steps)
    units = [zbv_rank_order(R, M, r) for r in range(R)]
    return build("zbv", v_placement(R), M, units, steps=T)


def dualpipev(ranks: int, chunks: int, steps: int = 1) -> Schedule:
    """DualPipeV on R = ``ranks`` ranks (2R stages as a V); needs M >= 2R."""
    R, M, T = _check(ranks, chunks, steps)
    if M < 2 * R:
        raise ValueError(
            f"dualpipev needs at least as many micro-batches as stages: chunks M={M} < 2R="
            f"{2 * R} (R={R} ranks, two stages each); use chunks >= {2 * R} or schedule 'zbv'"
        )
    units = [dualpipev_rank_order(R, M, r) for r in range(R)]
    return build("dualpipev", v_placement(R), M, units, steps=T)


def looped_bfs(ranks: int, virtual_stages: int, chunks: int, steps: int = 1) -> Schedule:
    """Looped BFS on R ranks with v = ``virtual_stages`` round-robin stages each."""
    R, M, T = _check(ranks, chunks, steps)
    v = check_positive_int("virtual_stages", virtual_stages, "a rank runs at least one stage")
    if v < 2:
        raise ValueError(f"looped_bfs needs virtual_stages >= 2, got {v}; use 'gpipe' for one")
    units = [looped_bfs_rank_order(R, v, M, r) for r in range(R)]
    return build("looped_bfs", loop_placement(R, R * v), M, units, steps=T)
