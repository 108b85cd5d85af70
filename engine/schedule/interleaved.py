"""Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): v virtual stages per rank.

Why a generator of its own: the other families are one stage per rank, one stream per
stage. Here the S*v virtual stages keep one action list each (so the validator, the analysis,
the renderer and the in-process runtime work per virtual stage unchanged) and the schedule
adds, per rank, the order in which the rank runs its v stages' actions
(:attr:`Schedule.rank_order`). Virtual stage s runs on rank s % R.

The per-rank order is Megatron's, as torch.distributed.pipelining's ScheduleInterleaved1F1B
computes it (rebuilt here from the paper's rules, not copied): micro-batches go in rounds of
``mpr`` = M / max(1, M // R) (R when R divides M); forward step i runs local chunk
(i // mpr) % v, backward step i local chunk v-1 - ((i - warmup) // mpr) % v; rank r warms up
with min((v-1)*mpr + 2(R-1-r), v*M) forwards, then alternates one forward and one backward,
then drains the backwards. Each mini-batch flushes (one update per virtual stage applying its
M gradients), so the schedule is synchronous and its gradients equal the unpipelined model's.
"""

from __future__ import annotations

from dataclasses import replace

from engine._checks import check_positive_int
from engine.schedule.ir import Action, Kind, Schedule
from engine.schedule.lower import with_comms
from engine.schedule.simulate import unit_ticks

__all__ = ["NAME", "interleaved", "rank_compute_order"]

NAME = "interleaved"


def _rounds(ranks: int, chunks: int) -> int:
    """Micro-batches per round; M must be a multiple of the number of rounds."""
    rounds = max(1, chunks // ranks)
    if chunks % rounds:
        raise ValueError(
            f"interleaved 1F1B runs micro-batches in rounds of about R={ranks}: chunks M="
            f"{chunks} must be a multiple of max(1, M // R) = {rounds}; use M < R, a "
            f"multiple of R, or another M"
        )
    return chunks // rounds


def rank_compute_order(ranks: int, virtual: int, chunks: int, rank: int) -> list[tuple[int, Kind, int]]:
    """Rank ``rank``'s compute for one mini-batch: (virtual stage, F or B, micro-batch)."""
    R, v, M = ranks, virtual, chunks
    mpr = _rounds(R, M)
    total = v * M
    warmup = min((v - 1) * mpr + 2 * (R - 1 - rank), total)
    fwd_next = [0] * v
    bwd_next = [0] * v
    out: list[tuple[int, Kind, int]] = []

    def forward(i: int) -> None:
        c = (i // mpr) % v
        out.append((c * R + rank, Kind.FORWARD, fwd_next[c]))
        fwd_next[c] += 1

    def backward(i: int) -> None:
        c = v - 1 - ((i - warmup) // mpr) % v
        out.append((c * R + rank, Kind.BACKWARD, bwd_next[c]))
        bwd_next[c] += 1

    for i in range(warmup):
        forward(i)
    for i in range(warmup, total):
        forward(i)
        backward(i)
    for i in range(total, total + warmup):
        backward(i)
    return out


def interleaved(ranks: int, virtual_stages: int, chunks: int, steps: int = 1) -> Schedule:
    """The interleaved 1F1B schedule on R = ``ranks`` ranks with v = ``virtual_stages`` each.

    The result has ``stages`` = R*v virtual stages, k = M (one flush per mini-batch) and ticks
    from a unit-cost run of the per-rank order; validate() checks it rank by rank.
    """
    R = check_positive_int("ranks", ranks, "a pipeline needs at least one rank")
    v = check_positive_int("virtual_stages", virtual_stages, "a rank runs at least one stage")
    M = check_positive_int("chunks", chunks, "a mini-batch needs at least one micro-batch")
    T = check_positive_int("steps", steps, "cover at least one mini-batch")
    if v < 2:
        raise ValueError(
            f"virtual_stages must be >= 2 for interleaving, got {v}; with one stage per rank "
            "use schedule '1f1b'"
        )
    V = R * v
    actions: list[list[Action]] = [[] for _ in range(V)]
    order: list[list[int]] = [[] for _ in range(R)]
    for t in range(T):
        base = t * M
        for r in range(R):
            for vs, kind, m in rank_compute_order(R, v, M, r):
                n = base + m
                new = with_comms(vs, V, Action(kind, (n,)))
                if kind is Kind.BACKWARD and m == M - 1:
                    new.append(Action.update(range(base, base + M)))
                actions[vs].extend(new)
                order[r].extend([vs] * len(new))
    sched = Schedule(
        name=NAME,
        stages=V,
        chunks=M,
        steps=T,
        update_size=M,
        order=NAME,
        weights="live",
        actions=tuple(map(tuple, actions)),
        virtual_stages=v,
        rank_order=tuple(map(tuple, order)),
    )
    return replace(sched, ticks=unit_ticks(sched))
