"""V-Min and V-Half: V-shaped schedules built from one repeated block whose lifespan sets memory.

Why (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024): a pipeline
schedule can be read as one *building block* -- where each stage's F, B and W of a single
micro-batch sit on the clock -- repeated every few slots. A rank holds the activations of a
stage from its F to its W, so the block's *lifespan* on a rank divided by the repetition
interval is the rank's peak activation memory. On the V placement (R ranks, 2R stages, rank r
holds stages r and 2R-1-r, as ZB-V) each rank runs six passes per micro-batch (F, B, W of two
stages), so the block repeats every 6 unit slots (F = B = W = 1) and the steady state has no
bubble; the block's shape alone decides the memory:

* **V-Min**: the forwards run back to back down and up the V (stage s at slot s), the
  backwards back to back after a gap g (stage 2R-1-k at slot 2R+g+k): the shortest lifespan,
  peak (R+4)//3 micro-batches of a rank's layers where 1F1B holds R.
* **V-Half**: the forwards run every other slot down the V and back to back up it, the
  backwards every other slot down its second half and back to back up its first half (rank r:
  F at 2r and 3R-2-r, B at 3R-1+g+2r and 6R-2+g-r): peak (R+2)//2, with less bubble than
  V-Min (the paper: bubble about R/(2M) against V-Min's 2R/(3M) and 1F1B's R/M).

The gap g is the smallest that makes the block *repeat without collision* (on every rank its
four F/B slots fall in distinct residues mod 6), found by search, not typed in: 2 for V-Min
when 3 divides R, 3 for V-Half when R is even, else 0.

From block to schedule (the paper's repeat, squeeze and reorder, done here as one pass):

1. *repeat*: micro-batch n's F and B sit at the block's slots + 6n;
2. *weights*: every slot a rank leaves empty runs the W of its oldest backward still waiting
   for one, so a stage's activations go as early as the block allows;
3. *compact*: visiting the passes in slot order, each moves to the earliest free slot of its
   rank after its dependencies (the previous stage's F, the next stage's B, its own F/B,
   the same stage's previous micro-batch), a forward only where the rank then holds no more
   than the repeated block's peak at every slot it covers. Moving a pass earlier never delays
   another, so the result stays a valid timed schedule; the warm-up and the cool-down fill up
   while the steady state, already full, stays as the block made it.

Each rank's slot order is its compute order; :func:`~engine.schedule.ranked.build` adds the
updates (one per stage after its last W: synchronous, k = M) and the communication.
"""

from __future__ import annotations

from collections.abc import Callable

from engine._checks import check_positive_int
from engine.schedule.ir import Action, Kind, Schedule
from engine.schedule.ranked import Unit, build, v_placement

__all__ = ["vhalf_block", "vmin_block", "Block", "block_peak", "block_slots", "vblock_rank_orders",
           "vhalf", "vmin"]

#: one repetition of the block: six passes per rank (F, B, W of two stages)
INTERVAL = 6

_Key = tuple[int, Kind, int]  # (stage, kind, micro-batch)
#: a block: ``block(R, r, g)`` -> rank r's slots of (F of its first stage, F of its second,
#: B of its second, B of its first) for micro-batch 0, with gap g before the backwards
Block = Callable[[int, int, int], tuple[int, int, int, int]]


def vmin_block(R: int, r: int, g: int) -> tuple[int, int, int, int]:
    """V-Min's block: forwards and backwards back to back (module docstring)."""
    return (r, 2 * R - 1 - r, 2 * R + g + r, 4 * R + g - 1 - r)


def vhalf_block(R: int, r: int, g: int) -> tuple[int, int, int, int]:
    """V-Half's block: every other slot on one half of the V each way (module docstring)."""
    return (2 * r, 3 * R - 2 - r, 3 * R - 1 + g + 2 * r, 6 * R - 2 + g - r)


def block_slots(block: Block, ranks: int) -> tuple[tuple[tuple[int, int, int, int], ...], int]:
    """``block`` on R = ``ranks``: per rank its four F/B slots for micro-batch 0, with the
    smallest gap g that makes the block repeat every 6 slots without collision."""
    R = check_positive_int("ranks", ranks, "a pipeline needs at least one rank")
    for g in range(INTERVAL * 2):
        rows = tuple(block(R, r, g) for r in range(R))
        if all(len({t % INTERVAL for t in row}) == len(row) for row in rows):
            return rows, g
    raise AssertionError(f"no collision-free gap for block {block.__name__} on {R} ranks")


def _deps(key: _Key, S: int) -> list[_Key]:
    s, k, n = key
    out: list[_Key] = [(s, k, n - 1)] if n > 0 else []
    if k is Kind.FORWARD:
        if s > 0:
            out.append((s - 1, k, n))
    elif k is Kind.BACKWARD:
        out.append((s, Kind.FORWARD, n))
        if s < S - 1:
            out.append((s + 1, k, n))
    else:
        out.append((s, Kind.BACKWARD, n))
    return out


def _repeat(R: int, M: int, rows: tuple[tuple[int, int, int, int], ...]) -> dict[_Key, int]:
    """Steps 1 and 2 of the module docstring: every pass of M micro-batches on a slot."""
    slot: dict[_Key, int] = {}
    for r, row in enumerate(rows):
        first, second = r, 2 * R - 1 - r
        kinds = ((first, Kind.FORWARD), (second, Kind.FORWARD),
                 (second, Kind.BACKWARD), (first, Kind.BACKWARD))
        timed = sorted(
            (t + INTERVAL * n, (s, k, n)) for n in range(M) for t, (s, k) in zip(row, kinds, strict=True)
        )
        waiting: list[tuple[int, int]] = []  # backwards whose W has not run, oldest first
        i = t = 0
        while i < len(timed) or waiting:
            if i < len(timed) and timed[i][0] == t:
                s, k, n = timed[i][1]
                slot[(s, k, n)] = t
                if k is Kind.BACKWARD:
                    waiting.append((s, n))
                i += 1
            elif waiting:
                s, n = waiting.pop(0)
                slot[(s, Kind.WEIGHT, n)] = t
            t += 1
    return slot


def _held(R: int, slot: dict[_Key, int], rank_of: Callable[[int], int]) -> list[list[int]]:
    """Per rank and slot, the micro-batches whose activations the rank holds (F to its W)."""
    end = max(slot.values()) + 2
    delta = [[0] * (end + 1) for _ in range(R)]
    for (s, k, _), t in slot.items():
        if k is Kind.FORWARD:
            delta[rank_of(s)][t] += 1
        elif k is Kind.WEIGHT:
            delta[rank_of(s)][t + 1] -= 1
    held = []
    for d in delta:
        run, row = 0, []
        for x in d:
            run += x
            row.append(run)
        held.append(row)
    return held


def _compact(R: int, slot: dict[_Key, int]) -> None:
    """Step 3 of the module docstring, in place."""
    S = 2 * R

    def rank_of(s: int) -> int:
        return s if s < R else S - 1 - s

    held = _held(R, slot, rank_of)
    cap = max(max(row) for row in held)
    taken = [set() for _ in range(R)]
    for key, t in slot.items():
        taken[rank_of(key[0])].add(t)
    for key in sorted(slot, key=lambda k: (slot[k], rank_of(k[0]))):
        t1 = slot[key]
        r = rank_of(key[0])
        lo = max((slot[d] + 1 for d in _deps(key, S)), default=0)
        room = held[r]
        t0 = None
        peak = 0
        for t in range(t1 - 1, lo - 1, -1):  # held[t..t1) only grows as t goes down
            peak = max(peak, room[t])
            if key[1] is Kind.FORWARD and peak + 1 > cap:
                break
            if t not in taken[r]:
                t0 = t
        if t0 is None:
            continue
        taken[r].discard(t1)
        taken[r].add(t0)
        slot[key] = t0
        if key[1] is Kind.FORWARD:
            for t in range(t0, t1):
                room[t] += 1
        elif key[1] is Kind.WEIGHT:
            for t in range(t0 + 1, t1 + 1):
                room[t] -= 1


def vblock_rank_orders(block: Block, ranks: int, chunks: int) -> list[list[Unit]]:
    """Every rank's compute order for one mini-batch of ``block`` (module docstring)."""
    R = check_positive_int("ranks", ranks, "a pipeline needs at least one rank")
    M = check_positive_int("chunks", chunks, "a mini-batch needs at least one micro-batch")
    rows, _ = block_slots(block, R)
    slot = _repeat(R, M, rows)
    _compact(R, slot)
    units: list[list[Unit]] = [[] for _ in range(R)]
    for (s, k, n), _t in sorted(slot.items(), key=lambda kv: kv[1]):
        units[s if s < R else 2 * R - 1 - s].append(((s, Action(k, (n,))),))
    return units


def block_peak(block: Block, ranks: int, chunks: int) -> int:
    """The most micro-batches (of one stage each) a rank holds at once under ``block``: the
    repeated block's peak, which the compaction never exceeds (the schedule's activation
    bound; in a rank's layers, half of it)."""
    R = check_positive_int("ranks", ranks, "a pipeline needs at least one rank")
    M = check_positive_int("chunks", chunks, "a mini-batch needs at least one micro-batch")
    rows, _ = block_slots(block, R)
    held = _held(R, _repeat(R, M, rows), lambda s: s if s < R else 2 * R - 1 - s)
    return max(max(row) for row in held)


def _build(name: str, block: Block, ranks: int, chunks: int, steps: int) -> Schedule:
    T = check_positive_int("steps", steps, "cover at least one mini-batch")
    units = vblock_rank_orders(block, ranks, chunks)
    return build(name, v_placement(ranks), chunks, units, steps=T)


def vmin(ranks: int, chunks: int, steps: int = 1) -> Schedule:
    """V-Min on R = ``ranks`` ranks (2R stages as a V), M = ``chunks``, T = ``steps``."""
    return _build("vmin", vmin_block, ranks, chunks, steps)


def vhalf(ranks: int, chunks: int, steps: int = 1) -> Schedule:
    """V-Half on R = ``ranks`` ranks (2R stages as a V), M = ``chunks``, T = ``steps``."""
    return _build("vhalf", vhalf_block, ranks, chunks, steps)
