"""``schedule="auto"``: the fastest family and placement whose predicted memory fits a cap.

Why: activation memory, not compute, decides what a pipeline can train, and the catalog holds
thirteen families whose memory and bubble trade against each other (V-Min holds a third of
1F1B's activations, ZB-V none of its bubble). Given what each stage costs -- forward and
backward time, the bytes one micro-batch leaves saved until its backward, and the bytes the
stage holds whatever the schedule (weights, gradient, optimizer state, buffers), as the
partitioner profiles or a profile file declares them -- the chooser:

1. lists the candidates: every family of the catalog that runs the S stages with M = ``chunks``
   (synchronous ones for ``"auto"``; also the asynchronous ones, in each order, for
   ``"auto-async"``), in each placement the stages admit -- one stage per rank on S ranks,
   the V on S/2, round-robin with every v >= 2 dividing S -- or, given ``ranks``, only the
   placements on that many ranks;
2. simulates each under the stage costs (:mod:`engine.schedule.simulate`; a split backward's
   W costs half the backward) and predicts every rank's peak memory: its stages' fixed bytes
   (plus the extra weight versions of stashing families) and the most activation bytes it
   holds at once along its order (:func:`engine.schedule.analysis.rank_activation_bytes`);
3. keeps those whose peak fits the cap on every rank and picks the least simulated step time
   (a mini-batch's makespan; for asynchronous families the steady-state time per mini-batch),
   ties going to fewer ranks, then to catalog order.

When nothing fits, :class:`NoScheduleFits` names the cap, every family tried with its peak,
and the smallest cap that would have fitted (the least peak among the candidates).

Step times compare candidates on the rank counts they use: without ``ranks`` (a local run,
where every stage shares one process) one stage per rank uses S ranks and the V S/2, so a
loose cap favours the one-stage-per-rank zero-bubble family; under a fixed process count the
placements on that many ranks compete. Importing this module does not import torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.schedule.analysis import analyze, rank_activation_bytes, steady_steps
from engine.schedule.catalog import ROWS, Family
from engine.schedule.ir import Schedule
from engine.schedule.simulate import Costs

__all__ = ["AUTO_FACTS", "CHOOSERS", "Candidate", "Choice", "NoScheduleFits", "StageCosts",
           "candidates", "choose_schedule", "pick"]

#: the names Pipeline(schedule=...) accepts for a choice: synchronous families only, or any
CHOOSERS: tuple[str, ...] = ("auto", "auto-async")
#: what every choice of ``"auto"`` shares, for checks made before the choice (the command
#: line's options): synchronous, live weights, k = M, no order to pick. Not a catalog row.
AUTO_FACTS = Family(
    CHOOSERS[0], True, (CHOOSERS[0],), "live", True, False,
    "the fastest synchronous family whose predicted peak fits the memory cap",
)


@dataclass(frozen=True)
class StageCosts:
    """What one stage costs per micro-batch (times in seconds, sizes in bytes)."""

    forward: float
    backward: float
    #: saved for the backward by one micro-batch (held from its F to its W / whole B)
    activation_bytes: int
    #: held whatever the schedule: weights, gradient, optimizer state, buffers
    fixed_bytes: int = 0
    #: one copy of the weights: what each extra version of a stashing family costs
    param_bytes: int = 0


@dataclass(frozen=True)
class Candidate:
    """One family and placement, simulated: its step time and each rank's predicted peak."""

    family: str
    ranks: int
    virtual_stages: int | None
    order: str | None
    step_time: float
    peak_bytes: tuple[int, ...]

    @property
    def peak(self) -> int:
        return max(self.peak_bytes)

    def label(self) -> str:
        what = self.family + (f" (order {self.order})" if self.order else "")
        v = f", v={self.virtual_stages}" if self.virtual_stages else ""
        return f"{what} on {self.ranks} rank{'s' if self.ranks != 1 else ''}{v}"


@dataclass(frozen=True)
class Choice:
    """What the chooser picked, and the candidates it weighed."""

    chosen: Candidate
    cap: float | None
    tried: tuple[Candidate, ...] = field(default=())
    #: candidates the stage count or M rule out, with why (e.g. dualpipev needs M >= 2R)
    skipped: tuple[tuple[str, str], ...] = field(default=())

    @property
    def family(self) -> str:
        return self.chosen.family

    @property
    def virtual_stages(self) -> int | None:
        return self.chosen.virtual_stages

    @property
    def order(self) -> str | None:
        return self.chosen.order

    def reason(self) -> str:
        """One line: what was chosen, its step time and peak, against the cap and the rest."""
        c = self.chosen
        fits = [t for t in self.tried if self.cap is None or t.peak <= self.cap]
        faster = [t for t in self.tried if t.step_time < c.step_time and t not in fits]
        cap = "no cap" if self.cap is None else f"cap {_fmt(self.cap)}"
        line = (
            f"schedule auto chose {c.label()}: simulated step {c.step_time:.4g} s, peak "
            f"{_fmt(c.peak)} per rank ({cap}); fastest of {len(fits)} fitting of "
            f"{len(self.tried)} tried"
        )
        if faster:
            best = min(faster, key=lambda t: t.step_time)
            line += f"; faster but over the cap: {best.label()} (peak {_fmt(best.peak)})"
        return line

    def as_dict(self) -> dict[str, object]:
        """What ``pipe.stats()["schedule_choice"]`` reports."""
        return {
            "family": self.family,
            "virtual_stages": self.virtual_stages,
            "order": self.order,
            "ranks": self.chosen.ranks,
            "step_time": self.chosen.step_time,
            "peak_bytes": list(self.chosen.peak_bytes),
            "cap": self.cap,
            "reason": self.reason(),
            "tried": {t.label(): {"step_time": t.step_time, "peak": t.peak} for t in self.tried},
        }


class NoScheduleFits(ValueError):
    """No family's predicted peak fits the cap; the message gives the smallest cap that does."""


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.4g} {unit} ({int(n)} B)"
    return f"{int(n)} B"


def _placements(row: Family, S: int, ranks: int | None) -> list[int | None]:
    """The v values (None: the row's own placement) that run ``S`` stages on ``ranks``."""
    per = row.placement.per_rank
    if per is not None:
        if S % per or (ranks is not None and S // per != ranks):
            return []
        return [None]
    vs = [v for v in range(2, S + 1) if S % v == 0]
    return [v for v in vs if ranks is None or S // v == ranks]


def _build(row: Family, S: int, M: int, v: int | None, order: str | None) -> Schedule:
    from engine.schedule.generators import generate

    if row.is_program:
        return row.program_for(S, M, virtual_stages=v)
    steps = 1 if row.synchronous else steady_steps(row.name, S, M)
    return generate(row.name, S, M, steps=steps, order=order)


def _evaluate(
    row: Family, costs: Sequence[StageCosts], M: int, v: int | None, order: str | None
) -> Candidate:
    S = len(costs)
    program = _build(row, S, M, v, order)
    sim = Costs(forward=[c.forward for c in costs], backward=[c.backward for c in costs])
    report = analyze(program, sim)
    acts = rank_activation_bytes(program, [c.activation_bytes for c in costs])
    peaks = []
    for r in range(program.ranks):
        fixed = sum(
            costs[s].fixed_bytes + (row.weight_versions(S, s) - 1) * costs[s].param_bytes
            for s in program.rank_stages(r)
        )
        peaks.append(fixed + acts[r])
    step = report.makespan / program.steps
    shown_order = order if len(row.orders) > 1 else None
    return Candidate(row.name, program.ranks, v, shown_order, step, tuple(peaks))


def candidates(
    costs: Sequence[StageCosts], *, chunks: int, ranks: int | None = None,
    asynchronous: bool = False,
) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """Every family and placement that runs these stages, simulated (module docstring, steps
    1 and 2), and those the stage count or ``chunks`` rule out with why."""
    S = len(costs)
    out: list[Candidate] = []
    skipped: list[tuple[str, str]] = []
    for row in ROWS:
        if not (row.synchronous or asynchronous):
            continue
        places = _placements(row, S, ranks)
        if not places:
            where = f" on {ranks} ranks" if ranks is not None else ""
            skipped.append((row.name, f"cannot place {S} stages ({row.placement.label}){where}"))
            continue
        for v in places:
            for order in row.orders if not row.is_program else (None,):
                try:
                    out.append(_evaluate(row, costs, chunks, v, order))
                except ValueError as exc:  # e.g. dualpipev's M >= 2R, interleaved's rounds
                    skipped.append((row.name, str(exc).split(";")[0]))
    return out, skipped


def choose_schedule(
    costs: Sequence[StageCosts],
    *,
    chunks: int,
    memory_cap_bytes: float | None,
    ranks: int | None = None,
    asynchronous: bool = False,
) -> Choice:
    """The fastest family and placement whose predicted peak fits ``memory_cap_bytes`` on
    every rank (module docstring); :class:`NoScheduleFits` when none does."""
    if not costs:
        raise ValueError("choose_schedule needs the costs of at least one stage")
    _check_cap(memory_cap_bytes)
    tried, skipped = candidates(costs, chunks=chunks, ranks=ranks, asynchronous=asynchronous)
    if not tried:
        why = "; ".join(f"{n}: {w}" for n, w in skipped)
        raise ValueError(f"no family runs {len(costs)} stages with chunks={chunks}: {why}")
    return pick(tried, memory_cap_bytes, skipped=skipped, asynchronous=asynchronous)


def _check_cap(cap: object) -> None:
    if cap is not None and not (
        isinstance(cap, (int, float)) and not isinstance(cap, bool) and math.isfinite(cap)
        and cap > 0
    ):
        raise ValueError(f"memory_cap_bytes must be a positive number, got {cap!r}")


def pick(
    tried: Sequence[Candidate],
    memory_cap_bytes: float | None,
    *,
    skipped: Sequence[tuple[str, str]] = (),
    asynchronous: bool = False,
) -> Choice:
    """Step 3 of the module docstring over simulated ``tried`` candidates."""
    _check_cap(memory_cap_bytes)
    fits = [c for c in tried if memory_cap_bytes is None or c.peak <= memory_cap_bytes]
    if not fits:
        least = min(tried, key=lambda c: (c.peak, c.step_time))
        listing = ", ".join(f"{c.label()} {_fmt(c.peak)}" for c in sorted(tried, key=lambda c: c.peak))
        kind = "synchronous " if not asynchronous else ""
        raise NoScheduleFits(
            f"no {kind}schedule fits memory_cap_bytes={memory_cap_bytes!r} on every rank: the "
            f"smallest cap that fits is {least.peak} bytes ({least.label()}). Predicted peak "
            f"per rank of each family tried: {listing}. Raise the cap, use more stages, "
            "or recompute activations (checkpoint=)"
        )
    index = {r.name: i for i, r in enumerate(ROWS)}
    best = min(fits, key=lambda c: (c.step_time, c.ranks, index[c.family]))
    return Choice(best, memory_cap_bytes, tuple(tried), tuple(skipped))
