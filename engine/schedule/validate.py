"""The validator: a schedule is checked before anything executes it.

Why: a wrong schedule in a distributed run hangs (a receive that no send matches) or
silently trains something else (a gradient applied twice, a backward on the wrong weights).
Every rule below is cheap (linear in the number of actions plus one clock simulation) so
the runtime can validate every schedule it is given, and every error names the stage, the
action index and the action, e.g. ``stage 1, action 4 (B3): backward before its forward F3``.

Rules, in the order they are checked:

0. Channels: the activation sends of s and receives of s+1 (and the gradient sends of s+1
   and receives of s) list the same micro-batches in the same order (checked first, so a
   missing receive is reported as the unmatched send it leaves behind).
1. Per stage, in order: micro-batch indices in 0 .. T*M-1; no action twice; F(n) before
   B(n); a send after the compute that produced it; with communication actions, RF(n)
   before F(n) (s > 0) and RB(n) before B(n) (s < S-1); no send or receive towards a
   stage that does not exist; an update only applies gradients already computed and not
   yet applied, and applies ``update_size`` of them; a W(n) (weight gradient split off
   B(n)) comes after B(n), and the update applying n after W(n).
2. Every micro-batch has F and B on every stage, and every gradient is applied by exactly
   one update on every stage.
3. A global-clock simulation finishes (no deadlock). With virtual stages it runs each rank's
   actions one at a time in ``rank_order`` (what one process per rank does).
4. If ticks are given: they never decrease along a stage and every cross-stage dependency
   lies in a strictly earlier tick.
5. Weights: under ``2bw`` the version a forward needs has been produced when it runs.
6. Activation memory (micro-batches between F and B on a stage) stays within the bound of
   ALGORITHMS.md for the schedule: gpipe M; 1f1b, pipedream, 2bw (and pb in 1f1b order) S-s;
   pb in dataflow order 2(S-1-s)+1; naive 1; zbh1 min(M, S) (a split backward holds its
   activations until W); zbv and dualpipev min(M, S-s), vmin and vhalf min(M, their block's
   rank peak), looped_bfs M (programs named and ordered so, e.g. generated): the bound of the
   family's catalog row. Schedules with other names are checked against
   ``activation_bounds`` only if given.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.schedule.catalog import lookup
from engine.schedule.errors import ScheduleError
from engine.schedule.ir import Action, Kind, Schedule
from engine.schedule.simulate import Costs, Timeline, remote_dependency, simulate
from engine.schedule.versions import stage_versions


def activation_bound(schedule: Schedule, stage: int) -> int | None:
    """ALGORITHMS.md's bound on micro-batches whose activations ``stage`` holds, or None for a
    schedule that is not a built-in family (give ``activation_bounds`` to check it)."""
    fam = lookup(schedule.name)
    if fam is None or schedule.order not in fam.orders:
        return None
    return fam.activation_bound(schedule.stages, stage, schedule.chunks, schedule.order)


def _static_stage(schedule: Schedule, s: int) -> None:
    S, N = schedule.stages, schedule.num_micro_batches
    comms = schedule.has_comms
    seen: dict[tuple[Kind, int], int] = {}
    applied: dict[int, int] = {}
    split = schedule.split_mbs(s)
    for i, a in enumerate(schedule.actions[s]):

        def fail(msg: str, i: int = i, a: Action = a) -> ScheduleError:
            return ScheduleError(msg, stage=s, index=i, action=a)

        for m in a.mbs:
            if not 0 <= m < N:
                raise fail(
                    f"micro-batch {m} is out of range: steps*chunks = {N} micro-batches are "
                    f"numbered 0..{N - 1}"
                )
        peer = s + a.kind.peer_offset
        if a.kind.is_comm and not 0 <= peer < S:
            raise fail(f"its peer would be stage {peer}, which does not exist (S={S})")
        if a.kind is Kind.UPDATE:
            if len(a.mbs) != schedule.update_size:
                raise fail(
                    f"update applies {len(a.mbs)} gradients but update_size is "
                    f"{schedule.update_size}"
                )
            for m in a.mbs:
                if (Kind.BACKWARD, m) not in seen:
                    raise fail(
                        f"update applies the gradient of micro-batch {m}, but its backward "
                        f"B{m} has not run on this stage yet; move the update after B{m}"
                    )
                if m in split and (Kind.WEIGHT, m) not in seen:
                    raise fail(
                        f"update applies the gradient of micro-batch {m}, but its weight "
                        f"gradient W{m} has not run on this stage yet; move the update after W{m}"
                    )
                if m in applied:
                    raise fail(
                        f"gradient of micro-batch {m} is applied twice (first by action "
                        f"{applied[m]} ({schedule.actions[s][applied[m]]}))"
                    )
                applied[m] = i
            continue
        n = a.mb
        key = (a.kind, n)
        if key in seen:
            raise fail(f"{a} appears twice on this stage (first at action {seen[key]})")
        if a.kind is Kind.FORWARD:
            if comms and s > 0 and (Kind.RECV_ACT, n) not in seen:
                raise fail(f"forward before receiving its input; put RF{n} before it")
        elif a.kind is Kind.BACKWARD:
            if (Kind.FORWARD, n) not in seen:
                raise fail(f"backward before its forward F{n}")
            if comms and s < S - 1 and (Kind.RECV_GRAD, n) not in seen:
                raise fail(f"backward before receiving its output gradient; put RB{n} before it")
        elif a.kind is Kind.WEIGHT:
            if (Kind.BACKWARD, n) not in seen:
                raise fail(f"weight gradient before its input-gradient backward B{n}")
        elif a.kind is Kind.SEND_ACT:
            if (Kind.FORWARD, n) not in seen:
                raise fail(f"sends the activation of micro-batch {n} before computing it (F{n})")
        elif a.kind is Kind.SEND_GRAD:
            if (Kind.BACKWARD, n) not in seen:
                raise fail(
                    f"sends the input gradient of micro-batch {n} before computing it (B{n})"
                )
        seen[key] = i
    for n in range(N):
        for kind in (Kind.FORWARD, Kind.BACKWARD):
            if (kind, n) not in seen:
                raise ScheduleError(
                    f"micro-batch {n} never runs its {'forward' if kind is Kind.FORWARD else 'backward'} "
                    f"({kind.value}{n}); every micro-batch 0..{N - 1} must pass every stage",
                    stage=s,
                )
        if n not in applied:
            bi = seen[(Kind.BACKWARD, n)]
            raise ScheduleError(
                f"gradient of micro-batch {n} is never applied by an update; add it to a U "
                f"after this action",
                stage=s,
                index=bi,
                action=schedule.actions[s][bi],
            )


def _channels(schedule: Schedule) -> None:
    S = schedule.stages
    for s in range(S - 1):
        for send_stage, recv_stage, send_kind, recv_kind, what in (
            (s, s + 1, Kind.SEND_ACT, Kind.RECV_ACT, "activation"),
            (s + 1, s, Kind.SEND_GRAD, Kind.RECV_GRAD, "input gradient"),
        ):
            sends = [
                (i, a) for i, a in enumerate(schedule.actions[send_stage]) if a.kind is send_kind
            ]
            recvs = [
                (i, a) for i, a in enumerate(schedule.actions[recv_stage]) if a.kind is recv_kind
            ]
            for c, ((si, sa), (ri, ra)) in enumerate(zip(sends, recvs, strict=False)):
                if sa.mb != ra.mb:
                    raise ScheduleError(
                        f"receives the {what} of micro-batch {ra.mb} from stage {send_stage}, "
                        f"but send number {c} on that channel is stage {send_stage}'s action "
                        f"{si} ({sa}); sends and receives on a channel must list the same "
                        f"micro-batches in the same order",
                        stage=recv_stage,
                        index=ri,
                        action=ra,
                    )
            if len(sends) > len(recvs):
                si, sa = sends[len(recvs)]
                raise ScheduleError(
                    f"unmatched send: stage {recv_stage} has no matching receive "
                    f"{recv_kind.value}{sa.mb}",
                    stage=send_stage,
                    index=si,
                    action=sa,
                )
            if len(recvs) > len(sends):
                ri, ra = recvs[len(sends)]
                raise ScheduleError(
                    f"unmatched receive: stage {send_stage} never sends {send_kind.value}{ra.mb}",
                    stage=recv_stage,
                    index=ri,
                    action=ra,
                )


def _ticks(schedule: Schedule) -> None:
    assert schedule.ticks is not None
    comms = schedule.has_comms
    where = [
        {(a.kind, a.mb): i for i, a in enumerate(acts) if a.kind is not Kind.UPDATE}
        for acts in schedule.actions
    ]
    for s, (acts, ticks) in enumerate(zip(schedule.actions, schedule.ticks, strict=True)):
        for i, (a, t) in enumerate(zip(acts, ticks, strict=True)):
            if t < 0 or (i and t < ticks[i - 1]):
                raise ScheduleError(
                    f"tick {t} is before the previous action's tick {ticks[i - 1] if i else 0}; "
                    f"ticks must not decrease along a stage",
                    stage=s,
                    index=i,
                    action=a,
                )
            dep = remote_dependency(schedule, s, a, comms)
            if dep is not None:
                r, da = dep
                j = where[r][(da.kind, da.mb)]
                if schedule.ticks[r][j] >= t:
                    raise ScheduleError(
                        f"placed at tick {t}, but it depends on {da} on stage {r} at tick "
                        f"{schedule.ticks[r][j]}; a cross-stage dependency must lie in an "
                        f"earlier tick",
                        stage=s,
                        index=i,
                        action=a,
                    )


def _weights_and_memory(schedule: Schedule, bounds: Sequence[int] | None) -> None:
    for s in range(schedule.stages):
        if schedule.weights == "2bw":
            for v in stage_versions(schedule, s).values():
                if v.version_F > v.t_F:
                    raise ScheduleError(
                        f"2bw forward of micro-batch {v.mb} needs weight version "
                        f"{v.version_F} but only {v.t_F} updates have been applied on this "
                        f"stage; with 2bw use chunks M >= stages S",
                        stage=s,
                        index=v.f_index,
                        action=schedule.actions[s][v.f_index],
                    )
        bound = bounds[s] if bounds is not None else activation_bound(schedule, s)
        if bound is None:
            continue
        held = 0
        split = schedule.split_mbs(s)
        for i, a in enumerate(schedule.actions[s]):
            if a.kind is Kind.FORWARD:
                held += 1
                if held > bound:
                    raise ScheduleError(
                        f"holds the activations of {held} micro-batches after this forward, "
                        f"above the bound {bound} for schedule {schedule.name!r} at stage "
                        f"{s} (ALGORITHMS.md, activation memory); run backwards earlier",
                        stage=s,
                        index=i,
                        action=a,
                    )
            elif schedule.releases_activations(s, a, split):
                held -= 1


def validate(
    schedule: Schedule,
    *,
    activation_bounds: Sequence[int] | None = None,
    costs: Costs | None = None,
) -> Timeline:
    """Check every rule of the module docstring; raise :class:`ScheduleError` on the first broken one.

    ``activation_bounds`` (one int per stage) overrides the ALGORITHMS.md bounds. Returns the
    global-clock :class:`Timeline` of the check's simulation under ``costs`` (default F=1, B=2).
    """
    if activation_bounds is not None and len(activation_bounds) != schedule.stages:
        raise ValueError(
            f"activation_bounds gives {len(activation_bounds)} values for {schedule.stages} stages"
        )
    _channels(schedule)
    for s in range(schedule.stages):
        _static_stage(schedule, s)
    timeline = simulate(schedule, costs)
    if schedule.ticks is not None:
        _ticks(schedule)
    _weights_and_memory(schedule, activation_bounds)
    return timeline
