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

from engine.schedule.ir import Action, Kind, Schedule
from engine.schedule.simulate import UNIT_COSTS, simulate

SCHEDULES: tuple[str, ...] = ("naive", "gpipe", "1f1b", "pipedream", "2bw", "pb")

#: order each schedule runs in; pb also accepts "1f1b"
ORDERS: dict[str, tuple[str, ...]] = {
    "naive": ("naive",),
    "gpipe": ("fill-drain",),
    "1f1b": ("1f1b",),
    "pipedream": ("1f1b",),
    "2bw": ("1f1b",),
    "pb": ("dataflow", "1f1b"),
}

WEIGHTS: dict[str, str] = {
    "naive": "live",
    "gpipe": "live",
    "1f1b": "live",
    "pipedream": "stash",
    "2bw": "2bw",
    "pb": "live",
}

SYNCHRONOUS: frozenset[str] = frozenset({"naive", "gpipe", "1f1b"})


def _check_int(what: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}; {fix}")
    return value


def _one_f_one_b(stage: int, S: int, mbs: list[int]) -> list[Action]:
    """Warm-up S-1-s forwards, then alternate F/B (forward first), then drain the backwards."""
    warm = min(S - 1 - stage, len(mbs))
    seq = [Action.forward(n) for n in mbs[:warm]]
    for i in range(len(mbs) - warm):
        seq.append(Action.forward(mbs[i + warm]))
        seq.append(Action.backward(mbs[i]))
    seq.extend(Action.backward(n) for n in mbs[len(mbs) - warm :])
    return seq


def _insert_updates(seq: list[Action], k: int) -> list[Action]:
    """Put an update after every k-th backward, applying exactly those k gradients."""
    out: list[Action] = []
    pending: list[int] = []
    for a in seq:
        out.append(a)
        if a.kind is Kind.BACKWARD:
            pending.append(a.mb)
            if len(pending) == k:
                out.append(Action.update(pending))
                pending = []
    if pending:  # generators require k | T*M, so this cannot happen; fail loudly if it does
        raise AssertionError(f"{len(pending)} gradients left without an update")
    return out


def _with_comms(stage: int, S: int, seq: list[Action]) -> list[Action]:
    out: list[Action] = []
    for a in seq:
        if a.kind is Kind.FORWARD:
            if stage > 0:
                out.append(Action.recv_act(a.mb))
            out.append(a)
            if stage < S - 1:
                out.append(Action.send_act(a.mb))
        elif a.kind is Kind.BACKWARD:
            if stage < S - 1:
                out.append(Action.recv_grad(a.mb))
            out.append(a)
            if stage > 0:
                out.append(Action.send_grad(a.mb))
        else:
            out.append(a)
    return out


def _unit_ticks(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Ticks from an as-soon-as-possible run where F and B take one tick each.

    Sends and updates share the tick of the compute before them, receives that of the
    compute after them, so a column of the text form reads like a pipeline diagram.
    """
    tl = simulate(schedule, UNIT_COSTS)
    out: list[tuple[int, ...]] = []
    for acts, starts in zip(schedule.actions, tl.start, strict=True):
        compute = [i for i, a in enumerate(acts) if a.kind.is_compute]
        ticks: list[int] = []
        for i, a in enumerate(acts):
            if a.kind.is_compute:
                ticks.append(int(starts[i]))
                continue
            before = [j for j in compute if j < i]
            after = [j for j in compute if j > i]
            if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                ref = after[0] if after else before[-1]
            else:
                ref = before[-1] if before else after[0]
            ticks.append(int(starts[ref]))
        out.append(tuple(ticks))
    return tuple(out)


def _dataflow(S: int, N: int, k: int) -> tuple[list[list[Action]], list[list[int]]]:
    """pb dataflow: at tick t stage s runs F(t-s), then B(t-2(S-1)+s), then its update."""
    actions: list[list[Action]] = [[] for _ in range(S)]
    ticks: list[list[int]] = [[] for _ in range(S)]
    for s in range(S):
        done = 0
        for t in range(N + 2 * (S - 1)):
            group: list[Action] = []
            f = t - s
            if 0 <= f < N:
                group.append(Action.forward(f))
            b = t - 2 * (S - 1) + s
            if 0 <= b < N:
                group.append(Action.backward(b))
            group = _with_comms(s, S, group)
            if 0 <= b < N:
                done += 1
                if done % k == 0:
                    group.append(Action.update(range(b - k + 1, b + 1)))
            actions[s].extend(group)
            ticks[s].extend([t] * len(group))
    return actions, ticks


def generate(
    name: str,
    stages: int,
    chunks: int,
    steps: int = 1,
    update_size: int | None = None,
    order: str | None = None,
) -> Schedule:
    """Build the schedule ``name`` for S = ``stages``, M = ``chunks``, T = ``steps`` mini-batches.

    Args:
        name: one of :data:`SCHEDULES`.
        stages: S >= 1 pipeline stages.
        chunks: M >= 1 micro-batches per mini-batch (2bw needs M >= S).
        steps: T >= 1 mini-batches; async schedules run them without flushing in between.
        update_size: k, micro-batches per update. Synchronous schedules and 2bw update once
            per mini-batch (k = M, the default); pipedream and pb default to k = 1. k must
            divide T*M so the final drain applies a full update.
        order: only for pb: ``"dataflow"`` (default; Kosson et al.'s ticks) or ``"1f1b"``.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}")
    S = _check_int("stages", stages, "a pipeline needs at least one stage")
    M = _check_int("chunks", chunks, "a mini-batch needs at least one micro-batch")
    T = _check_int("steps", steps, "cover at least one mini-batch")
    N = M * T
    if order is None:
        order = ORDERS[name][0]
    if order not in ORDERS[name]:
        raise ValueError(
            f"schedule {name!r} runs in order {' or '.join(map(repr, ORDERS[name]))}, not "
            f"{order!r}; leave order unset"
            + (" (only pb chooses between 'dataflow' and '1f1b')" if name != "pb" else "")
        )
    per_minibatch = name in SYNCHRONOUS or name == "2bw"
    if update_size is None:
        k = M if per_minibatch else 1
    else:
        k = _check_int("update_size", update_size, "an update applies at least one gradient")
        if per_minibatch and k != M:
            raise ValueError(
                f"{name!r} updates once per mini-batch, so update_size must equal chunks "
                f"(M={M}), got {k}; drop update_size or use 'pipedream'/'pb' for other sizes"
            )
    if N % k:
        raise ValueError(
            f"update_size k={k} must divide the number of micro-batches steps*chunks = {N} so "
            f"every gradient is applied by a full update; choose k among "
            f"{[d for d in range(1, N + 1) if N % d == 0]} or change steps"
        )
    if name == "2bw" and M < S:
        raise ValueError(
            f"2bw needs chunks M >= stages S, got M={M} < S={S}: with fewer micro-batches per "
            f"mini-batch than stages, a forward would need a weight version that is not yet "
            f"produced and two versions would not suffice. Use chunks >= {S}, or schedule "
            f"'pipedream' (weight stashing) for small M"
        )

    ticks: list[list[int]] | None = None
    if order == "dataflow":
        actions, ticks = _dataflow(S, N, k)
    else:
        actions = []
        for s in range(S):
            if name == "naive":
                seq = [a for n in range(N) for a in (Action.forward(n), Action.backward(n))]
            elif name == "gpipe":
                seq = []
                for j in range(T):
                    mbs = range(j * M, (j + 1) * M)
                    seq += [Action.forward(n) for n in mbs] + [Action.backward(n) for n in mbs]
            elif name == "1f1b":
                seq = []
                for j in range(T):
                    seq += _one_f_one_b(s, S, list(range(j * M, (j + 1) * M)))
            else:  # pipedream, 2bw, pb in 1f1b order: async 1F1B over all T*M micro-batches
                seq = _one_f_one_b(s, S, list(range(N)))
            actions.append(_with_comms(s, S, _insert_updates(seq, k)))
    schedule = Schedule(
        name=name,
        stages=S,
        chunks=M,
        steps=T,
        update_size=k,
        order=order,
        weights=WEIGHTS[name],
        actions=tuple(tuple(a) for a in actions),
        ticks=None if ticks is None else tuple(tuple(t) for t in ticks),
    )
    if schedule.ticks is None:
        schedule = replace(schedule, ticks=_unit_ticks(schedule))
    return schedule
