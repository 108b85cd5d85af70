"""Lowering: turn a compute-only program into one every transport can execute.

Why: a hand-written program is easiest to write and read in the compact form
``s0: F0 F1 B0 B1 U0-1`` (torch.distributed.pipelining calls this the compute-only IR and
adds the communication in a pass, too). Multi-process transports need the sends and receives
spelled out, and the runtime's step compiler reads them to know where a stage waits for a
neighbour. :func:`add_comms` inserts them exactly as the built-in generators place them
(``RF`` before a forward on s > 0, ``SF`` after it on s < S-1, ``RB`` before a backward on
s < S-1, ``SB`` after it on s > 0), so a lowered hand-written twin of a built-in schedule is
*equal* to the generated one.

:func:`flushes_every_minibatch` decides whether a program is synchronous, from its actions
alone.
"""

from __future__ import annotations

from dataclasses import replace

from engine.schedule.ir import Action, Kind, Schedule

__all__ = ["add_comms", "flushes_every_minibatch", "with_comms"]


def with_comms(stage: int, S: int, a: Action) -> list[Action]:
    """``a`` with the receive before it and the send after it, as every generator places
    them (module docstring); an update or a weight gradient alone."""
    if a.kind is Kind.FORWARD:
        out = [Action.recv_act(a.mb)] if stage > 0 else []
        out.append(a)
        if stage < S - 1:
            out.append(Action.send_act(a.mb))
        return out
    if a.kind is Kind.BACKWARD:
        out = [Action.recv_grad(a.mb)] if stage < S - 1 else []
        out.append(a)
        if stage > 0:
            out.append(Action.send_grad(a.mb))
        return out
    return [a]


def add_comms(program: Schedule) -> Schedule:
    """``program`` with sends and receives around every forward and backward; returned
    unchanged when it already has communication actions. Ticks are kept (a receive shares
    the tick of the compute after it, a send that of the compute before it)."""
    if program.has_comms:
        return program
    if program.rank_order is not None:
        return _add_comms_by_rank(program)
    S = program.stages
    actions: list[tuple[Action, ...]] = []
    ticks: list[tuple[int, ...]] | None = [] if program.ticks is not None else None
    sizes: list[list[int]] = []  # actions each original action became (for the rank order)
    for s, acts in enumerate(program.actions):
        out: list[Action] = []
        tks: list[int] = []
        sizes.append([])
        for i, a in enumerate(acts):
            wrapped = with_comms(s, S, a)
            out.extend(wrapped)
            sizes[s].append(len(wrapped))
            if program.ticks is not None:
                tks.extend([program.ticks[s][i]] * len(wrapped))
        actions.append(tuple(out))
        if ticks is not None:
            ticks.append(tuple(tks))
    order = program.rank_order
    if order is not None:
        order = tuple(
            tuple(vs for vs, i in program.rank_sequence(r) for _ in range(sizes[vs][i]))
            for r in range(program.ranks)
        )
    return replace(
        program,
        actions=tuple(actions),
        ticks=None if ticks is None else tuple(ticks),
        rank_order=order,
    )


def flushes_every_minibatch(program: Schedule) -> bool:
    """True when every stage runs mini-batch after mini-batch: its list splits into
    ``steps`` consecutive blocks, block j touching only micro-batches jM .. (j+1)M-1 and
    applying all of their gradients before block j+1 starts. Such a program has no
    staleness (every delay is 0) and the pipeline runs it step by step with rollback."""
    M = program.chunks
    for acts in program.actions:
        block = 0
        pending: set[int] = set()
        for a in acts:
            mbs = a.mbs
            j = mbs[0] // M
            if any(m // M != j for m in mbs):
                return False
            if j != block:
                if j != block + 1 or pending:
                    return False
                block = j
            if a.kind is Kind.BACKWARD:
                pending.add(a.mb)
            elif a.kind is Kind.UPDATE:
                pending.difference_update(mbs)
        if pending:
            return False
    return True


def _units(program: Schedule, rank: int) -> list[list[tuple[int, int]]]:
    """Rank ``rank``'s sequence cut into units: one action, or an overlapped pair."""
    paired = {(sa, a) for sa, a, _, _ in program.overlaps}
    units: list[list[tuple[int, int]]] = []
    glue = False
    for vs, i in program.rank_sequence(rank):
        if glue:
            units[-1].append((vs, i))
        else:
            units.append([(vs, i)])
        glue = (vs, program.actions[vs][i]) in paired
    return units


def unit_comms(
    program: Schedule, unit: list[tuple[int, Action]]
) -> tuple[list[tuple[int, Action]], list[tuple[int, Action]]]:
    """The receives before and the sends after one unit (an action or an overlapped pair), as
    (stage, action): receives from another rank first, then those from the rank itself; sends
    to the rank itself first, then those to other ranks. The CSV reader re-inserts the
    same-rank ones (TDP leaves them out) at exactly these places."""
    S = program.stages
    recvs: list[tuple[bool, int, Action]] = []
    sends: list[tuple[bool, int, Action]] = []
    for s, a in unit:
        w = with_comms(s, S, a)
        k = w.index(a)
        for c in w[:k]:
            peer = s + c.kind.peer_offset
            recvs.append((program.rank_of(peer) == program.rank_of(s), s, c))
        for c in w[k + 1 :]:
            peer = s + c.kind.peer_offset
            sends.append((program.rank_of(peer) != program.rank_of(s), s, c))
    recvs.sort(key=lambda x: x[0])
    sends.sort(key=lambda x: x[0])
    return [(s, c) for _, s, c in recvs], [(s, c) for _, s, c in sends]


def _add_comms_by_rank(program: Schedule) -> Schedule:
    actions: list[list[Action]] = [[] for _ in range(program.stages)]
    ticks: list[list[int]] | None = (
        [[] for _ in range(program.stages)] if program.ticks is not None else None
    )
    order: list[tuple[int, ...]] = []
    for r in range(program.ranks):
        seq: list[int] = []

        def emit(s: int, a: Action, t: int | None) -> None:
            actions[s].append(a)
            seq.append(s)
            if ticks is not None:
                ticks[s].append(t)  # type: ignore[arg-type]

        for unit in _units(program, r):
            acts = [(s, program.actions[s][i]) for s, i in unit]
            tk = [program.ticks[s][i] for s, i in unit] if program.ticks is not None else None
            recvs, sends = unit_comms(program, acts)
            for s, c in recvs:
                emit(s, c, tk[0] if tk else None)
            for j, (s, a) in enumerate(acts):
                emit(s, a, tk[j] if tk else None)
            for s, c in sends:
                emit(s, c, tk[-1] if tk else None)
        order.append(tuple(seq))
    return replace(
        program,
        actions=tuple(map(tuple, actions)),
        ticks=None if ticks is None else tuple(map(tuple, ticks)),
        rank_order=tuple(order),
    )
