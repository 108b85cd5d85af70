"""torch.distributed.pipelining's CSV schedules, in and out: :func:`from_csv`, :func:`to_csv`.

Why: TDP's ``_PipelineScheduleRuntime`` loads and dumps a schedule as CSV, one row per rank and
one action per cell, and torchtitan (``pipeline_parallel_schedule_csv``) and NeMo AutoModel
(``pp_schedule_csv``) accept such files. Reading and writing them lets a schedule written once
run here and there, and lets ours be checked by torch's runtime.

The format (torch 2.13, read from its ``_Action`` grammar, not copied):

* A cell is ``<stage><type><micro-batch>``: ``0F3`` forward, ``2B1`` whole backward, ``2I1``
  input-gradient backward, ``2W1`` weight gradient; ``(0F7;7B3)OVERLAP_F_B`` an overlapped
  pair; with communication (``compute_comms``) also ``0SEND_F3``/``1RECV_F3`` (activations to
  stage s+1 / from s-1), ``1SEND_B3``/``0RECV_B3`` (input gradients), ``0REDUCE_GRAD`` (the
  stage's gradients of the mini-batch are complete: here its update) and FSDP's
  ``0UNSHARD``/``0RESHARD``. An empty cell is an idle slot.
* ``compute_only`` rows hold compute cells only; the column is the time slot, so empty cells
  keep the clock. Here the column becomes the action's tick when those ticks are consistent
  (every dependency in an earlier column); the communication and each stage's update are then
  added as the generators place them (:mod:`engine.schedule.ranked`).
* ``compute_comms`` rows list every action a rank runs, in order. TDP writes no send or
  receive between two stages on the *same* rank (the V's turn); they are inserted here right
  before and after the cell that needs them and left out again on writing.

Mapping to the IR: ``I`` is our ``B`` of a micro-batch whose ``W`` runs apart, ``B`` our ``B``
without a ``W``; ``REDUCE_GRAD`` is the stage's update applying its M gradients (the
``compute_only`` reader adds it after the stage's last gradient, where TDP's lowering puts
it). What this engine cannot run is refused with the cell that holds it: ``UNSHARD`` /
``RESHARD`` (FSDP parameter gathering; this engine has no FSDP -- ``drop_fsdp=True`` reads the
schedule without them, which is what torch's runtime does for modules that are not FSDP), a
``REDUCE_GRAD`` before all of its stage's gradients exist, an ``I`` without its ``W``. Every
schedule read is validated (deadlock, dependencies; a failure names the CSV cell).

Round trips: ``from_csv(to_csv(s, fmt), name=s.name) == s`` for programs of one mini-batch
(placement, overlapped pairs and, for ``compute_only``, the clock included); a file torch's
schedule classes dump, read and written back, is the same file (``compute_comms`` files
without their UNSHARD/RESHARD cells, which ``drop_fsdp`` removes).
"""

from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import replace
from typing import Literal

from engine.errors import ScheduleError
from engine.schedule.ir import Action, Kind, Schedule
from engine.schedule.lower import unit_comms
from engine.schedule.ranked import Unit, build, loop_placement
from engine.schedule.validate import validate

__all__ = ["from_csv", "to_csv", "FORMATS"]

FORMATS = ("compute_only", "compute_comms")
Format = Literal["compute_only", "compute_comms"]

_CELL = re.compile(r"^(\d+)(F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD|UNSHARD|RESHARD)(\d*)$")
_PAIR = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_COMPUTE = {"F": Kind.FORWARD, "I": Kind.BACKWARD, "B": Kind.BACKWARD, "W": Kind.WEIGHT}
_COMM = {"SEND_F": Kind.SEND_ACT, "RECV_F": Kind.RECV_ACT, "SEND_B": Kind.SEND_GRAD,
         "RECV_B": Kind.RECV_GRAD}
_COMM_NAME = {v: k for k, v in _COMM.items()}


class _Cell:
    """One parsed cell: its place in the file and what it holds."""

    def __init__(self, rank: int, col: int, text: str) -> None:
        self.rank, self.col, self.text = rank, col, text
        self.where = f"row {rank + 1} (rank {rank}), column {col + 1} ({text!r})"

    def error(self, msg: str) -> ScheduleError:
        return ScheduleError(f"CSV {self.where}: {msg}")


def _read_rows(source: str | os.PathLike[str]) -> list[list[str]]:
    if isinstance(source, os.PathLike) or (
        isinstance(source, str) and "\n" not in source and os.path.isfile(source)
    ):
        with open(source, newline="") as f:
            text = f.read()
    elif isinstance(source, str) and "\n" not in source and source.lower().endswith(".csv"):
        raise ValueError(f"no CSV file {source!r} (give a path that exists, or the CSV text)")
    elif isinstance(source, str):
        text = source
    else:
        raise TypeError(f"from_csv takes a path or the CSV text, got {type(source).__name__}")
    rows = [[c.strip() for c in row] for row in csv.reader(io.StringIO(text))]
    while rows and not any(rows[-1]):
        rows.pop()
    if not rows:
        raise ValueError("empty CSV schedule: expected one row of actions per rank")
    return rows


def _parse_simple(cell: _Cell, text: str) -> tuple[int, str, int | None]:
    m = _CELL.match(text)
    if m is None:
        raise cell.error(
            "not an action; write <stage><type><micro-batch> such as 0F3, 2I1, 2W1, 1B0, "
            "0SEND_F3, 1RECV_B2 or 0REDUCE_GRAD, or (0F7;7B3)OVERLAP_F_B"
        )
    stage, typ, mb = m.groups()
    if typ in ("UNSHARD", "RESHARD", "REDUCE_GRAD"):
        if mb:
            raise cell.error(f"{typ} takes no micro-batch")
        return int(stage), typ, None
    if not mb:
        raise cell.error(f"{typ} needs a micro-batch index, e.g. {stage}{typ}0")
    return int(stage), typ, int(mb)


def _parse(rows: list[list[str]], drop_fsdp: bool) -> list[list[tuple[_Cell, list[tuple[int, str, int | None]]]]]:
    """Per rank, the non-empty cells with their actions (two for a pair)."""
    out = []
    for r, row in enumerate(rows):
        cells = []
        for c, text in enumerate(row):
            if not text:
                continue
            cell = _Cell(r, c, text)
            pair = _PAIR.match(text)
            if pair:
                subs = [_parse_simple(cell, t.strip()) for t in pair.group(1).split(";")]
                if len(subs) != 2 or any(t not in _COMPUTE for _, t, _ in subs):
                    raise cell.error("an overlapped pair holds exactly two compute actions")
                cells.append((cell, subs))
                continue
            if text.startswith("("):
                raise cell.error("the only compound action is (a;b)OVERLAP_F_B")
            st, typ, mb = _parse_simple(cell, text)
            if typ in ("UNSHARD", "RESHARD"):
                if drop_fsdp:
                    continue
                raise cell.error(
                    f"{typ} gathers or frees FSDP-sharded parameters, and this engine has no "
                    "FSDP; pass drop_fsdp=True to read the schedule without them (torch's runtime "
                    "skips them for modules that are not FSDP)"
                )
            cells.append((cell, [(st, typ, mb)]))
        out.append(cells)
    return out


def _placement(parsed: list, rows: int) -> tuple[tuple[int, ...], ...]:
    owner: dict[int, int] = {}
    held: list[list[int]] = [[] for _ in range(rows)]
    for r, cells in enumerate(parsed):
        for cell, subs in cells:
            for st, _, _ in subs:
                if owner.setdefault(st, r) != r:
                    raise cell.error(
                        f"stage {st} also appears on rank {owner[st]}: every stage runs on one rank"
                    )
                if st not in held[r]:
                    held[r].append(st)
    S = max(owner, default=-1) + 1
    missing = sorted(set(range(S)) - set(owner))
    if missing:
        raise ValueError(f"the CSV never mentions stages {missing} of stages 0..{S - 1}")
    sizes = {len(h) for h in held}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(
            f"every rank must hold the same number of stages (>= 1); the CSV gives ranks "
            f"{[sorted(h) for h in held]}"
        )
    return tuple(tuple(sorted(h)) for h in held)


def _to_action(cell: _Cell, typ: str, mb: int) -> Action:
    if typ in _COMPUTE:
        return Action(_COMPUTE[typ], (mb,))
    return Action(_COMM[typ], (mb,))


def _check_split(parsed: list) -> None:
    """``I`` needs its ``W``; a whole ``B`` must have none."""
    ws = {(st, mb) for cells in parsed for _, subs in cells for st, t, mb in subs if t == "W"}
    for cells in parsed:
        for cell, subs in cells:
            for st, t, mb in subs:
                if t == "I" and (st, mb) not in ws:
                    raise cell.error(
                        f"input-gradient backward of micro-batch {mb} on stage {st} has no weight "
                        f"gradient {st}W{mb}; write {st}B{mb} for a whole backward"
                    )
                if t == "B" and (st, mb) in ws:
                    raise cell.error(
                        f"whole backward, but {st}W{mb} also computes its weight gradient; write "
                        f"{st}I{mb} for the input-gradient half"
                    )


def _check_order(parsed: list) -> None:
    """Per row, no backward ahead of its forward and no ``W`` ahead of its ``I`` in the same row.

    Why here, before the validator: the validator checks the channels between stages first,
    so a row whose ``0B0`` was moved ahead of ``0F0`` would be reported at the receive it
    puts out of order on the *next* row; the user edited this cell, so it names this cell.
    (An action missing from its row is the validator's to report.)"""
    needs = {"B": "F", "I": "F", "W": "I"}
    for cells in parsed:
        later = {(st, t, mb) for _, subs in cells for st, t, mb in subs}
        for cell, subs in cells:
            for st, t, mb in subs:
                later.discard((st, t, mb))
                first = needs.get(t)
                if first is not None and (st, first, mb) in later:
                    what = "forward" if first == "F" else "input-gradient backward"
                    raise cell.error(
                        f"{st}{t}{mb} comes before its {what} {st}{first}{mb}, later in this "
                        f"row; move it after {st}{first}{mb}"
                    )


def from_csv(
    source: str | os.PathLike[str],
    *,
    format: Format | None = None,
    name: str = "csv",
    order: str | None = None,
    chunks: int | None = None,
    drop_fsdp: bool = False,
) -> Schedule:
    """Read a TDP CSV schedule (a path or the text) into a validated program.

    Args:
        format: ``"compute_only"`` or ``"compute_comms"``; None: ``compute_comms`` when a cell
            sends or receives, else ``compute_only``.
        name, order: the program's name and order (order defaults to the name).
        chunks: M, micro-batches per mini-batch (default: the largest index + 1).
        drop_fsdp: read ``UNSHARD``/``RESHARD`` cells as no-ops instead of refusing them.

    Raises ScheduleError naming the cell (row = rank, column) of anything that cannot run.
    """
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    rows = _read_rows(source)
    parsed = _parse(rows, drop_fsdp)
    comms = [
        (cell, t) for cells in parsed for cell, subs in cells for _, t, _ in subs
        if t in _COMM or t == "REDUCE_GRAD"
    ]
    fmt = format or ("compute_comms" if comms else "compute_only")
    if fmt == "compute_only" and comms:
        cell, t = comms[0]
        raise cell.error(f"{t} in a compute_only schedule; read it with format='compute_comms'")
    placement = _placement(parsed, len(rows))
    _check_split(parsed)
    _check_order(parsed)
    mbs = [mb for cells in parsed for _, subs in cells for _, _, mb in subs if mb is not None]
    M = max(mbs, default=-1) + 1 if chunks is None else chunks
    if M < 1:
        raise ValueError("the CSV holds no micro-batch")
    if fmt == "compute_only":
        sched = _compute_only(parsed, placement, M, name, order)
    else:
        sched = _compute_comms(parsed, placement, M, name, order)
    return sched


def _compute_only(parsed: list, placement: tuple, M: int, name: str, order: str | None) -> Schedule:
    units: list[list[Unit]] = []
    cols: dict[tuple[int, Action], _Cell] = {}
    for cells in parsed:
        rank_units = []
        for cell, subs in cells:
            unit = tuple((st, _to_action(cell, t, mb)) for st, t, mb in subs)
            for st, a in unit:
                if (st, a) in cols:
                    raise cell.error(f"{a} of stage {st} appears twice (first at {cols[(st, a)].where})")
                cols[(st, a)] = cell
            rank_units.append(unit)
        units.append(rank_units)
    try:
        sched = build(name, placement, M, units, order=order, ticks=False)
    except ValueError as exc:
        raise ScheduleError(f"CSV schedule {name!r}: {exc}") from None
    _validate(sched, cols)
    # the columns as ticks, when they are a consistent clock (every dependency earlier)
    ticks = _column_ticks(sched, cols)
    if ticks is not None:
        try:
            validate(replace(sched, ticks=ticks))
            return replace(sched, ticks=ticks)
        except ScheduleError:
            pass
    return sched


def _column_ticks(sched: Schedule, cols: dict) -> tuple[tuple[int, ...], ...] | None:
    out = []
    for s, acts in enumerate(sched.actions):
        compute = [(i, cols[(s, a)].col) for i, a in enumerate(acts) if (s, a) in cols]
        ticks = []
        for i, a in enumerate(acts):
            if (s, a) in cols:
                ticks.append(cols[(s, a)].col)
                continue
            before = [c for j, c in compute if j < i]
            after = [c for j, c in compute if j > i]
            recv = a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD)
            ticks.append((after[0] if after else before[-1]) if recv else (before[-1] if before else after[0]))
        out.append(tuple(ticks))
    return tuple(out)


def _validate(sched: Schedule, cells: dict) -> None:
    try:
        validate(sched)
    except ScheduleError as exc:
        a = exc.action
        cell = None
        if exc.stage is not None and a is not None:
            cell = cells.get((exc.stage, a))
            if cell is None and a.kind.is_comm:  # a communication: the cell of its compute
                act = a.kind in (Kind.SEND_ACT, Kind.RECV_ACT)
                cell = cells.get((exc.stage, Action(Kind.FORWARD if act else Kind.BACKWARD, a.mbs)))
        where = f" (CSV {cell.where}" if cell is not None else ""
        sender = _sender_cell(sched, exc, cells) if cell is not None else None
        if sender is not None and sender is not cell:
            where += f"; the send it meets: {sender.where}"
        raise ScheduleError(f"{exc}{where}{')' if where else ''}", stage=None) from None


def _sender_cell(sched: Schedule, exc: ScheduleError, cells: dict) -> _Cell | None:
    """For a receive that meets the wrong send: the cell of that send's compute, on the row
    that was probably edited (the receive's row is often untouched)."""
    a, r = exc.action, exc.stage
    if a is None or r is None or a.kind not in (Kind.RECV_ACT, Kind.RECV_GRAD):
        return None
    act = a.kind is Kind.RECV_ACT
    peer = r - 1 if act else r + 1
    send_kind = Kind.SEND_ACT if act else Kind.SEND_GRAD
    recvs = [x for x in sched.actions[r][: (exc.index or 0) + 1] if x.kind is a.kind]
    sends = [x for x in sched.actions[peer] if x.kind is send_kind]
    if not 0 <= peer < sched.stages or len(recvs) > len(sends):
        return None
    sent = sends[len(recvs) - 1]
    return cells.get((peer, Action(Kind.FORWARD if act else Kind.BACKWARD, sent.mbs)))


def _compute_comms(parsed: list, placement: tuple, M: int, name: str, order: str | None) -> Schedule:
    R = len(placement)
    S = sum(len(p) for p in placement)
    v = len(placement[0])
    round_robin = placement == loop_placement(R, S)
    probe = Schedule(  # only for rank_of and unit_comms
        name=name, stages=S, chunks=M, steps=1, update_size=M, order=order or name,
        weights="live", actions=tuple(() for _ in range(S)), virtual_stages=v,
        rank_order=tuple(() for _ in range(R)) if v > 1 else None,
        placement=None if round_robin else placement,
    )
    actions: list[list[Action]] = [[] for _ in range(S)]
    seq: list[list[int]] = [[] for _ in range(R)]
    overlaps = []
    cells: dict[tuple[int, Action], _Cell] = {}
    split = {(st, mb) for cs in parsed for _, subs in cs for st, t, mb in subs if t == "W"}
    for r, rank_cells in enumerate(parsed):
        done: dict[int, int] = {}

        def emit(st: int, a: Action, cell: _Cell, r: int = r) -> None:
            if (st, a) in cells and a.kind is not Kind.UPDATE:
                raise cell.error(f"{a} of stage {st} appears twice (first at {cells[(st, a)].where})")
            cells.setdefault((st, a), cell)
            actions[st].append(a)
            seq[r].append(st)

        for cell, subs in rank_cells:
            st0, t0, _ = subs[0]
            if t0 == "REDUCE_GRAD":
                if done.get(st0, 0) != M:
                    raise cell.error(
                        f"REDUCE_GRAD of stage {st0} after {done.get(st0, 0)} of its {M} "
                        "gradients; here it is the stage's update, which needs all of them "
                        "(put it after the stage's last W or whole B)"
                    )
                emit(st0, Action.update(range(M)), cell)
                done[st0] = -1
                continue
            if t0 in _COMM:
                emit(st0, _to_action(cell, t0, subs[0][2]), cell)  # type: ignore[arg-type]
                continue
            unit = [(st, _to_action(cell, t, mb)) for st, t, mb in subs]
            recvs, sends = unit_comms(probe, unit)
            for st, c in recvs:
                if probe.rank_of(st + c.kind.peer_offset) == r:
                    emit(st, c, cell)
            for st, a in unit:
                emit(st, a, cell)
                whole = a.kind is Kind.BACKWARD and (st, a.mb) not in split
                if a.kind is Kind.WEIGHT or whole:
                    done[st] = done.get(st, 0) + 1
            for st, c in sends:
                if probe.rank_of(st + c.kind.peer_offset) == r:
                    emit(st, c, cell)
            if len(unit) == 2:
                (sa, a), (sb, b) = unit
                overlaps.append((sa, a, sb, b))
        for st, n in done.items():
            if n != -1:
                raise ScheduleError(
                    f"CSV row {r + 1} (rank {r}): stage {st} has no REDUCE_GRAD; a "
                    "compute_comms schedule needs one per stage, after its last gradient"
                )
    try:
        sched = replace(
            probe,
            actions=tuple(map(tuple, actions)),
            rank_order=tuple(map(tuple, seq)) if v > 1 else None,
            overlaps=tuple(overlaps),
        )
    except ValueError as exc:
        raise ScheduleError(f"CSV schedule {name!r}: {exc}") from None
    _validate(sched, cells)
    from engine.schedule.ranked import unit_ticks

    return replace(sched, ticks=unit_ticks(sched))


def _rank_units(schedule: Schedule, rank: int) -> list[list[tuple[int, int]]]:
    if schedule.rank_order is None:
        return [[(rank, i)] for i in range(len(schedule.actions[rank]))]
    from engine.schedule.lower import _units

    return _units(schedule, rank)


def to_csv(
    schedule: Schedule,
    path: str | os.PathLike[str] | None = None,
    *,
    format: Format = "compute_only",
) -> str:
    """``schedule`` as TDP's CSV (returned, and written to ``path`` when given).

    Refused with a clear error: more than one mini-batch (TDP's schedule is one step), an update
    that does not apply all M gradients of its mini-batch, a weight policy other than live
    weights. ``compute_only`` keeps the clock as empty cells when ``schedule.ticks`` has one
    strictly increasing tick per cell of a rank.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    s = schedule
    if s.steps != 1:
        raise ValueError(
            f"a TDP CSV holds one mini-batch, but schedule {s.name!r} covers steps={s.steps}; "
            "generate it with steps=1"
        )
    if s.weights != "live" or s.update_size != s.chunks:
        raise ValueError(
            f"TDP runs synchronous schedules (live weights, one update of all M={s.chunks} "
            f"gradients per stage); {s.name!r} has weights={s.weights!r}, update_size="
            f"{s.update_size}"
        )
    if format == "compute_comms" and not s.has_comms:  # lowered as the runtime would
        from engine.schedule.lower import add_comms

        s = add_comms(s)
    rows: list[list[str]] = []
    for r in range(s.ranks):
        split = {(st, a.mb) for st in s.rank_stages(r) for a in s.actions[st] if a.kind is Kind.WEIGHT}

        def token(st: int, a: Action) -> str:
            if a.kind is Kind.UPDATE:
                return f"{st}REDUCE_GRAD"
            if a.kind.is_comm:
                return f"{st}{_COMM_NAME[a.kind]}{a.mb}"
            t = {Kind.FORWARD: "F", Kind.WEIGHT: "W"}.get(a.kind)
            if t is None:
                t = "I" if (st, a.mb) in split else "B"
            return f"{st}{t}{a.mb}"

        row: list[str] = []
        ticks: list[int] = []
        for unit in _rank_units(s, r):
            acts = [(st, s.actions[st][i]) for st, i in unit]
            st0, a0 = acts[0]
            if a0.kind is Kind.UPDATE:
                if len(a0.mbs) != s.chunks:
                    raise ValueError(f"stage {st0}'s update {a0} does not apply all M gradients")
                if format == "compute_comms":
                    row.append(token(st0, a0))
                continue
            if a0.kind.is_comm:
                if format == "compute_comms" and s.rank_of(st0 + a0.kind.peer_offset) != r:
                    row.append(token(st0, a0))
                continue
            text = ";".join(token(st, a) for st, a in acts)
            row.append(f"({text})OVERLAP_F_B" if len(acts) == 2 else text)
            if s.ticks is not None:
                st, i = unit[0]
                ticks.append(s.ticks[st][i])
        if format == "compute_only" and s.ticks is not None and all(
            b > a for a, b in zip(ticks, ticks[1:])
        ) and ticks and ticks[0] >= 0:
            spaced = [""] * (ticks[-1] + 1)
            for t, cell in zip(ticks, row, strict=True):
                spaced[t] = cell
            row = spaced
        rows.append(row)
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    text = buf.getvalue()
    if path is not None:
        with open(path, "w", newline="") as f:
            f.write(text)
    return text
