"""Analysis: the facts a schedule implies, measured by simulating it.

Why measured and never typed in: ALGORITHMS.md makes the delay D_s "a property of the
schedule: the engine derives it by simulating the schedule". The pipeline sets each stage
optimizer's ``delay`` from :attr:`ScheduleReport.delays`, ``pipe.stats()`` reports the same
numbers, and tests compare them with the closed forms (pb dataflow 2(S-1-s), pipedream and
pb-1f1b S-1-s, 2bw 1, synchronous 0; gpipe/1f1b bubble (S-1)/(M+S-1)).

Definitions used (per stage s):

* ``records[s][n]``: t_F, t_B, the weight versions F(n)/B(n) use (see
  :mod:`engine.schedule.versions`), the 1-based index of the update that applied n's
  gradient, the delay ``update - 1 - version_F``, and the simulated F/B start and end times.
* ``delays[s]``: **D_s**, the largest delay over the micro-batches, i.e. the steady-state
  delay (fill micro-batches see fewer updates; with T*M too small to reach steady state it
  is smaller than the formula, e.g. min(T*M-1, 2(S-1-s)) for pb dataflow). With k = 1 (and
  for the synchronous schedules and 2bw) every steady-state micro-batch has this delay.
  With k > 1 the delay varies inside an update group and D_s is the delay of the stalest
  gradient of a group: ceil(L/k) for a lag of L micro-batches (pb dataflow L = 2(S-1-s),
  1f1b order L = S-1-s). This is the one definition of D_s in the engine: the runtime sets
  it on the stage optimizers through :func:`schedule_delays` (see docs/ALGORITHMS.md,
  "Choices made by this implementation").
* ``mean_delays[s]``: with k > 1 the delay varies inside an update group (the first
  gradient of a group waits longer than the last); this is the mean over the middle half
  of the run, micro-batches N//4 .. 3N//4-1 (N = T*M), PipeMare's "about 2(S-1-s)/k".
  Run enough steps (T*M well above 2(S-1)+k) for it to be the steady-state value.
* ``versions[s]``: the most weight versions the stage must hold at once: the live weights
  plus every distinct version an in-flight micro-batch (F done, B not yet) will use in its
  backward; 1 under the ``live`` policy.
* ``activation_peak[s]``: the most micro-batches between F and B at once (F and W for a
  backward split into B and W: the weight gradient still reads the activations).
* ``bubble_fraction``: 1 - (busy time of all ranks) / (R * makespan) under the cost model
  (R = S without virtual stages); ``idle_fraction[s]`` the same per (virtual) stage.
* ``rank_activation_peak[r]``: the most micro-batches whose activations rank r's stages hold
  at once (walking the rank's order); the per-rank memory of multi-stage placements.
* ``rank_bubble[r]``: Megatron's bubble ratio of rank r, idle time / busy time. For
  interleaved 1F1B with equal costs per virtual stage it is exactly (R-1)/(v*M) whenever
  M >= R (and max(1, M // R) divides M); with M < R it is larger (tests/schedule/test_schedule_interleaved.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.schedule.catalog import family
from engine.schedule.ir import Kind, Schedule
from engine.schedule.simulate import Costs, Timeline
from engine.schedule.validate import validate
from engine.schedule.versions import stage_versions


@dataclass(frozen=True)
class MicroBatchRecord:
    """What happened to micro-batch ``mb`` on ``stage`` (times from the cost-model clock)."""

    stage: int
    mb: int
    t_F: int
    t_B: int
    version_F: int
    version_B: int
    update: int
    delay: int
    f_start: float
    f_end: float
    b_start: float
    b_end: float


@dataclass(frozen=True)
class ScheduleReport:
    """Per-stage facts of a schedule; see the module docstring for definitions."""

    schedule: Schedule
    costs: Costs
    delays: tuple[int, ...]
    mean_delays: tuple[float, ...]
    versions: tuple[int, ...]
    activation_peak: tuple[int, ...]
    bubble_fraction: float
    idle_fraction: tuple[float, ...]
    makespan: float
    records: tuple[tuple[MicroBatchRecord, ...], ...]
    timeline: Timeline
    rank_bubble: tuple[float, ...] = ()
    #: per rank, the most micro-batches whose activations its stages hold at once (the
    #: memory that matters when a rank holds several stages: ZB-V's claim is 1F1B's peak)
    rank_activation_peak: tuple[int, ...] = ()

    def record(self, stage: int, mb: int) -> MicroBatchRecord:
        """The record of micro-batch ``mb`` on ``stage``."""
        return self.records[stage][mb]

    def summary(self) -> str:
        """A few human-readable lines (what ``pipe.stats()`` prints)."""
        s = self.schedule
        lines = [
            f"{s.name} (order {s.order}, weights {s.weights}) S={s.stages}"
            + (f" (R={s.ranks} ranks x v={s.virtual_stages})" if s.rank_order is not None else "")
            + f" M={s.chunks} "
            f"T={s.steps} k={s.update_size}: bubble {self.bubble_fraction:.3f}, "
            f"makespan {self.makespan:g}"
        ]
        for st in range(s.stages):
            mean = self.mean_delays[st]
            extra = f" (steady mean {mean:g})" if mean != self.delays[st] else ""
            lines.append(
                f"  stage {st}: delay {self.delays[st]}{extra}, versions {self.versions[st]}, "
                f"activation peak {self.activation_peak[st]}, idle {self.idle_fraction[st]:.3f}"
            )
        if s.rank_order is not None:
            lines.extend(
                f"  rank {r} (stages {list(s.rank_stages(r))}): bubble ratio "
                f"idle/busy {b:.4f}, activation peak {p} micro-batches"
                for r, (b, p) in enumerate(zip(self.rank_bubble, self.rank_activation_peak, strict=True))
            )
        return "\n".join(lines + self._legend())

    def _legend(self) -> list[str]:
        """What each figure of :meth:`summary` is: three idle measures that differ in kind."""
        s, c = self.schedule, self.costs
        scalar = all(isinstance(v, int | float) for v in (c.forward, c.backward))
        units = (f"F={c.forward:g}, B={c.backward:g} (a split B and its W share that)" if scalar
                 else "the per-stage costs given")
        out = [
            "  legend: bubble = idle share of all ranks' time, 1 - busy / (ranks x makespan); "
            f"makespan in cost units, {units}",
            "    idle = the same share for one stage alone"
            + ("; a stage also idles while its rank runs its other stage, so it exceeds the "
               "bubble" if s.rank_order is not None else ""),
        ]
        if s.rank_order is not None:
            out.append("    bubble ratio = a rank's idle time / its busy time (Megatron's measure, "
                       "(R-1)/(v*M) for interleaved 1F1B), not a share of the makespan")
        return out


def rank_activation_bytes(schedule: Schedule, stage_bytes: Sequence[int]) -> tuple[int, ...]:
    """Per rank, the most bytes of saved activations it holds at once: walking the rank's
    order, a micro-batch counts ``stage_bytes[s]`` from its forward on stage s until the action
    that releases it (its W when the backward is split, else its B). With one byte per stage
    this is :attr:`ScheduleReport.rank_activation_peak`, in micro-batches; with each stage's
    saved bytes per micro-batch it is the rank's predicted activation memory (what
    bench/schedule_memory.py measures, and schedule="auto" compares with the cap)."""
    if len(stage_bytes) != schedule.stages:
        raise ValueError(
            f"stage_bytes gives {len(stage_bytes)} values for {schedule.stages} stages"
        )
    peaks = []
    for r in range(schedule.ranks):
        held = peak = 0
        splits = {st: schedule.split_mbs(st) for st in schedule.rank_stages(r)}
        for st, i in schedule.rank_sequence(r):
            a = schedule.actions[st][i]
            if a.kind is Kind.FORWARD:
                held += stage_bytes[st]
                peak = max(peak, held)
            elif schedule.releases_activations(st, a, splits[st]):
                held -= stage_bytes[st]
        peaks.append(peak)
    return tuple(peaks)


def as_costs(costs: Costs | Mapping[str, object] | None) -> Costs:
    """Accept a :class:`Costs` or a mapping with keys F, B, W, U, comm (numbers or per-stage lists)."""
    if costs is None:
        return Costs()
    if isinstance(costs, Costs):
        return costs
    names = {"F": "forward", "B": "backward", "W": "weight", "U": "update", "comm": "comm"}
    unknown = set(costs) - set(names) - set(names.values())
    if unknown:
        raise ValueError(f"unknown cost keys {sorted(unknown)}; use F, B, W, U and comm")
    return Costs(**{names.get(k, k): v for k, v in costs.items()})  # type: ignore[arg-type]


def steady_steps(name: str, stages: int, chunks: int, update_size: int | None = None) -> int:
    """Mini-batches T after which every stage of ``name`` has reached its steady-state delay.

    The fill lasts at most 2(S-1) micro-batches (pb dataflow) plus one update group; twice
    that, rounded up to whole mini-batches with k | T*M (the generators require it), leaves
    a steady window at least as long as the fill.
    """
    k = update_size if update_size is not None else family(name).default_update_size(chunks)
    target = 2 * (2 * stages + 2 * k + chunks)
    T = max(1, -(-target // chunks))
    while (T * chunks) % k:
        T += 1
    return T


def schedule_delays(
    name: str, stages: int, chunks: int, update_size: int | None = None, order: str | None = None
) -> tuple[int, ...]:
    """D_s of every stage for the open-ended schedule the runtime executes.

    Simulates ``generate(name, ...)`` over :func:`steady_steps` mini-batches and returns
    :attr:`ScheduleReport.delays` (the steady-state maximum). Every runtime and transport
    reads D_s from here, so the number a stage optimizer uses is the number the analysis
    reports.
    """
    from engine.schedule.generators import generate

    T = steady_steps(name, stages, chunks, update_size)
    sched = generate(name, stages, chunks, steps=T, update_size=update_size, order=order)
    return analyze(sched).delays


def analyze(
    schedule: Schedule, costs: Costs | Mapping[str, object] | None = None
) -> ScheduleReport:
    """Validate ``schedule``, simulate it under ``costs`` (default F=1, B=2) and report per stage."""
    cost = as_costs(costs)
    timeline = validate(schedule, costs=cost)
    S = schedule.stages
    delays: list[int] = []
    mean_delays: list[float] = []
    versions: list[int] = []
    peaks: list[int] = []
    records: list[tuple[MicroBatchRecord, ...]] = []
    idle: list[float] = []
    makespan = timeline.makespan
    busy_total = 0.0
    for s in range(S):
        vs = stage_versions(schedule, s)
        recs = []
        for n in range(schedule.num_micro_batches):
            v = vs[n]
            assert v.update is not None and v.delay is not None  # validate() guarantees
            recs.append(
                MicroBatchRecord(
                    stage=s,
                    mb=n,
                    t_F=v.t_F,
                    t_B=v.t_B,
                    version_F=v.version_F,
                    version_B=v.version_B,
                    update=v.update,
                    delay=v.delay,
                    f_start=timeline.start[s][v.f_index],
                    f_end=timeline.end[s][v.f_index],
                    b_start=timeline.start[s][v.b_index],
                    b_end=timeline.end[s][v.b_index],
                )
            )
        records.append(tuple(recs))
        delays.append(max(r.delay for r in recs))
        N = len(recs)
        window = recs[N // 4 : max(3 * N // 4, N // 4 + 1)]
        mean_delays.append(sum(r.delay for r in window) / len(window))
        t = 0
        in_flight: dict[int, int] = {}
        peak = 0
        held_versions = 1
        split = schedule.split_mbs(s)
        for a in schedule.actions[s]:
            if a.kind is Kind.FORWARD:
                in_flight[a.mb] = vs[a.mb].version_B
            elif schedule.releases_activations(s, a, split):
                in_flight.pop(a.mb, None)
            elif a.kind is Kind.UPDATE:
                t += 1
            peak = max(peak, len(in_flight))
            if schedule.weights != "live":
                held_versions = max(held_versions, len({t, *in_flight.values()}))
        peaks.append(peak)
        versions.append(held_versions)
        busy = sum(e - b for b, e in zip(timeline.start[s], timeline.end[s], strict=True))
        busy_total += busy
        idle.append(1.0 - busy / makespan if makespan > 0 else 0.0)
    rank_busy = [0.0] * schedule.ranks
    for s in range(S):
        rank_busy[schedule.rank_of(s)] += sum(
            e - b for b, e in zip(timeline.start[s], timeline.end[s], strict=True)
        )
    rank_bubble = tuple((makespan - b) / b if b > 0 else 0.0 for b in rank_busy)
    R = schedule.ranks
    bubble = 1.0 - busy_total / (R * makespan) if makespan > 0 else 0.0
    rank_peaks = rank_activation_bytes(schedule, [1] * S)
    return ScheduleReport(
        schedule=schedule,
        costs=cost,
        delays=tuple(delays),
        mean_delays=tuple(mean_delays),
        versions=tuple(versions),
        activation_peak=tuple(peaks),
        bubble_fraction=bubble,
        idle_fraction=tuple(idle),
        makespan=makespan,
        records=tuple(records),
        timeline=timeline,
        rank_bubble=rank_bubble,
        rank_activation_peak=tuple(rank_peaks),
    )
