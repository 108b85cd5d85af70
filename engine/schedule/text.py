"""The schedule text form: printable, diffable, parsable back to the identical IR.

Why a text form: golden files in review diffs, bug reports that paste a schedule, and a
hand-written schedule for a test are all easier as text than as Python literals. The format
is canonical -- ``format_schedule(parse(text)) == text`` for any text ``format_schedule``
produced, and ``parse(format_schedule(s)) == s`` for every schedule.

Example (``pb``, S=3, M=3, dataflow order; one column per tick)::

    schedule pb stages=3 chunks=3 steps=1 update_size=1 order=dataflow weights=live ticks=1
    s0: F0 SF0 | F1 SF1 | F2 SF2 | .     | RB0 B0 U0 | RB1 B1 U1 | RB2 B2 U2
    s1: .      | RF0 F0 SF0 | ...

Compact view: ``format_schedule(s, comms=False, ticks=False)`` prints only compute and
updates, e.g. for 1f1b S=2 M=2: ``s0: F0 F1 B0 B1 U0-1`` / ``s1: F0 B0 F1 B1 U0-1``.

Grammar:

* Header: ``schedule NAME stages=S chunks=M steps=T update_size=k order=O weights=W
  ticks=0|1``.
* One line per stage, ``s<index>: ...``, stages in order.
* With ``ticks=1`` a line is a sequence of tick groups separated by ``|``; group c holds the
  stage's actions in tick c (``.`` for an idle tick). Padding spaces are ignored on parse.
  With ``ticks=0`` the actions are separated by single spaces.
* Action tokens: ``F3`` ``B3`` (forward/backward of micro-batch 3), ``W3`` (its weight
  gradient, split off ``B3``), ``SF3``/``RF3`` (send
  activation to s+1 / receive from s-1), ``SB3``/``RB3`` (send input gradient to s-1 /
  receive from s+1), ``U0-3`` (update applying micro-batches 0..3; ``U5`` one micro-batch,
  ``U0-1+4`` any set: ranges joined by ``+``).
* Virtual stages (interleaved 1F1B): the header ends with ``virtual=v`` and the stage lines
  (one per virtual stage) are followed by one line per rank, ``r<index>: 0*3 2*3 0*1 ...``:
  the rank's order as runs ``stage*count`` (run ``count`` next actions of that virtual
  stage). Schedules without virtual stages print neither.
* Placement other than round-robin (V schedules): the header also has
  ``placement=0+3,1+2`` (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2).
* Overlapped pairs (DualPipeV's ``OVERLAP_F_B``): one line ``pairs: 0:F3/3:B1 ...`` after
  the rank lines, each pair as ``stage:action/stage:action``.
* Blank lines and lines starting with ``#`` are ignored.
"""

from __future__ import annotations

import re
from dataclasses import replace

from engine.schedule.ir import Action, Kind, Schedule, format_action

_TOKEN = re.compile(r"^(SF|RF|SB|RB|F|B|W|U)([0-9][0-9+\-]*)$")
_HEADER_KEYS = ("stages", "chunks", "steps", "update_size", "order", "weights", "ticks")
_OPTIONAL_KEYS = ("virtual", "placement")


def _format_rank_order(seq: tuple[int, ...]) -> str:
    runs: list[list[int]] = []
    for vs in seq:
        if runs and runs[-1][0] == vs:
            runs[-1][1] += 1
        else:
            runs.append([vs, 1])
    return " ".join(f"{vs}*{n}" for vs, n in runs)


def _parse_rank_order(no: int, body: str) -> tuple[int, ...]:
    out: list[int] = []
    for tok in body.split():
        vs, star, n = tok.partition("*")
        if not star or not vs.isdigit() or not n.isdigit() or int(n) < 1:
            raise ValueError(f"line {no}: bad rank-order run {tok!r}; write stage*count, e.g. 2*3")
        out.extend([int(vs)] * int(n))
    return tuple(out)


def parse_action(token: str) -> Action:
    """Inverse of :func:`format_action`."""
    m = _TOKEN.match(token.strip())
    if m is None:
        raise ValueError(
            f"cannot parse action {token!r}: expected F<n>, B<n>, W<n>, SF<n>, RF<n>, SB<n>, RB<n> "
            f"or U<ranges> such as U0-3 or U0-1+4"
        )
    prefix, body = m.groups()
    kind = Kind(prefix)
    if kind is Kind.UPDATE:
        mbs: list[int] = []
        for part in body.split("+"):
            lo, sep, hi = part.partition("-")
            if not lo or (sep and not hi):
                raise ValueError(f"bad micro-batch range {part!r} in update {token!r}")
            a, b = int(lo), int(hi) if sep else int(lo)
            if b < a:
                raise ValueError(f"empty range {part!r} in update {token!r}; write low-high")
            mbs.extend(range(a, b + 1))
        return Action.update(mbs)
    if not body.isdigit():
        raise ValueError(f"{prefix} takes one micro-batch index, got {token!r}")
    return Action(kind, (int(body),))


def strip(schedule: Schedule, *, comms: bool = False, ticks: bool = False) -> Schedule:
    """A copy without communication actions (``comms=False``) and/or without ticks.

    Dropping the sends and receives leaves a valid schedule whose cross-stage dependencies
    are implied (F(n) on s after F(n) on s-1, B(n) on s after B(n) on s+1): the compact
    view ``F0 F1 B0 U0 ...`` that is easier to read.
    """
    keep = [
        [i for i, a in enumerate(acts) if comms or not a.kind.is_comm] for acts in schedule.actions
    ]
    actions = tuple(
        tuple(acts[i] for i in k) for acts, k in zip(schedule.actions, keep, strict=True)
    )
    tks = None
    if ticks and schedule.ticks is not None:
        tks = tuple(tuple(ts[i] for i in k) for ts, k in zip(schedule.ticks, keep, strict=True))
    order = schedule.rank_order
    if order is not None:  # drop the dropped actions' entries from each rank's order
        kept = [set(k) for k in keep]
        order = tuple(
            tuple(vs for vs, i in schedule.rank_sequence(r) if i in kept[vs])
            for r in range(schedule.ranks)
        )
    return replace(schedule, actions=actions, ticks=tks, rank_order=order)


def format_schedule(schedule: Schedule, *, comms: bool = True, ticks: bool = True) -> str:
    """Canonical text form of ``schedule`` (header + one line per stage, newline-terminated).

    ``comms=False`` leaves out sends and receives, ``ticks=False`` prints plain action lists
    instead of tick columns; the result is then the text of :func:`strip`'s schedule (which
    still parses and validates), not of ``schedule`` itself.
    """
    s = schedule if comms and ticks else strip(schedule, comms=comms, ticks=ticks)
    header = (
        f"schedule {s.name} stages={s.stages} chunks={s.chunks} steps={s.steps} "
        f"update_size={s.update_size} order={s.order} weights={s.weights} "
        f"ticks={0 if s.ticks is None else 1}"
        + (f" virtual={s.virtual_stages}" if s.rank_order is not None else "")
        + (
            " placement=" + ",".join("+".join(map(str, r)) for r in s.placement)
            if s.placement is not None
            else ""
        )
    )
    ranks = (
        []
        if s.rank_order is None
        else [f"r{r}: {_format_rank_order(seq)}" for r, seq in enumerate(s.rank_order)]
    )
    if s.overlaps:
        ranks.append(
            "pairs: "
            + " ".join(f"{sa}:{format_action(a)}/{sb}:{format_action(b)}" for sa, a, sb, b in s.overlaps)
        )
    if " " in s.name or not s.name:
        raise ValueError(f"schedule name {s.name!r} must be one non-empty word for the text form")
    labels = [f"s{i}:" for i in range(s.stages)]
    width = max(len(x) for x in labels)
    lines = [header]
    if s.ticks is None:
        for label, acts in zip(labels, s.actions, strict=True):
            lines.append((label.ljust(width) + " " + " ".join(map(format_action, acts))).rstrip())
        return "\n".join(lines + ranks) + "\n"
    groups: list[list[str]] = []
    for acts, ticks in zip(s.actions, s.ticks, strict=True):
        n = (max(ticks) + 1) if ticks else 0
        cols: list[list[str]] = [[] for _ in range(n)]
        for a, t in zip(acts, ticks, strict=True):
            if t < 0:
                raise ValueError(f"ticks must be >= 0, got {t} for {format_action(a)}")
            cols[t].append(format_action(a))
        groups.append([" ".join(c) if c else "." for c in cols])
    ncols = max((len(g) for g in groups), default=0)
    col_w = [max((len(g[c]) for g in groups if c < len(g)), default=1) for c in range(ncols)]
    for label, g in zip(labels, groups, strict=True):
        body = " | ".join(txt.ljust(col_w[c]) for c, txt in enumerate(g))
        lines.append((label.ljust(width) + " " + body).rstrip())
    return "\n".join(lines + ranks) + "\n"


def parse(text: str) -> Schedule:
    """Parse the text form back into a :class:`Schedule` (exact inverse of format_schedule).

    Errors name the line and the token that is wrong.
    """
    lines = [
        (no, ln.strip())
        for no, ln in enumerate(text.splitlines(), 1)
        if ln.strip() and not ln.strip().startswith("#")
    ]
    if not lines:
        raise ValueError("empty schedule text: expected a 'schedule NAME stages=...' header")
    no, header = lines[0]
    words = header.split()
    if len(words) < 2 or words[0] != "schedule":
        raise ValueError(
            f"line {no}: expected the header 'schedule NAME stages=S chunks=M steps=T "
            f"update_size=k order=O weights=W ticks=0|1', got {header!r}"
        )
    name = words[1]
    fields: dict[str, str] = {}
    for w in words[2:]:
        key, eq, val = w.partition("=")
        if not eq or key not in _HEADER_KEYS + _OPTIONAL_KEYS:
            raise ValueError(
                f"line {no}: unknown header field {w!r}; known: {_HEADER_KEYS + _OPTIONAL_KEYS}"
            )
        fields[key] = val
    missing = [k for k in _HEADER_KEYS if k not in fields]
    if missing:
        raise ValueError(
            f"line {no}: header lacks {missing}; every field of {_HEADER_KEYS} is required"
        )
    try:
        S, M, T, k = (int(fields[x]) for x in ("stages", "chunks", "steps", "update_size"))
    except ValueError as e:
        raise ValueError(
            f"line {no}: stages/chunks/steps/update_size must be integers ({e})"
        ) from None
    if fields["ticks"] not in ("0", "1"):
        raise ValueError(f"line {no}: ticks must be 0 or 1, got {fields['ticks']!r}")
    with_ticks = fields["ticks"] == "1"
    virtual = fields.get("virtual")
    if virtual is not None and not virtual.isdigit():
        raise ValueError(f"line {no}: virtual must be an integer, got {virtual!r}")
    v = int(virtual) if virtual is not None else 1
    pair_lines = [(n, ln) for n, ln in lines[1:] if ln.startswith("pairs:")]
    lines = [(n, ln) for n, ln in lines if not ln.startswith("pairs:")]
    body = [(n, ln) for n, ln in lines[1:] if not ln.startswith("r")]
    rank_lines = [(n, ln) for n, ln in lines[1:] if ln.startswith("r")]
    overlaps = [p for n, ln in pair_lines for p in _parse_pairs(n, ln.partition(":")[2])]
    placement = None
    if "placement" in fields:
        try:
            placement = tuple(
                tuple(int(x) for x in r.split("+")) for r in fields["placement"].split(",")
            )
        except ValueError:
            raise ValueError(
                f"line {no}: bad placement {fields['placement']!r}; write the stages of each "
                "rank joined by '+', ranks separated by ',', e.g. placement=0+3,1+2"
            ) from None
    if virtual is None and rank_lines:
        raise ValueError(f"line {rank_lines[0][0]}: rank-order lines need virtual=v in the header")
    rank_order: list[tuple[int, ...]] = []
    for r, (n, ln) in enumerate(rank_lines):
        label, colon, rest = ln.partition(":")
        if not colon or label.strip() != f"r{r}":
            raise ValueError(f"line {n}: expected rank line 'r{r}: ...', got {ln!r}")
        rank_order.append(_parse_rank_order(n, rest))
    if len(body) != S:
        raise ValueError(f"header says stages={S} but {len(body)} stage lines follow")
    actions: list[tuple[Action, ...]] = []
    ticks: list[tuple[int, ...]] = []
    for s, (no, ln) in enumerate(body):
        label, colon, rest = ln.partition(":")
        if not colon or label.strip() != f"s{s}":
            raise ValueError(f"line {no}: expected stage line 's{s}: ...', got {ln!r}")
        acts: list[Action] = []
        tks: list[int] = []
        rest = rest.strip()
        if rest:
            parts = rest.split("|") if with_ticks else [rest]
            for t, part in enumerate(parts):
                toks = part.split()
                if with_ticks and toks == ["."]:
                    continue
                if with_ticks and not toks:
                    raise ValueError(f"line {no}: tick {t} is empty; write '.' for an idle tick")
                for tok in toks:
                    try:
                        acts.append(parse_action(tok))
                    except ValueError as e:
                        raise ValueError(f"line {no} (stage {s}): {e}") from None
                    tks.append(t)
        actions.append(tuple(acts))
        ticks.append(tuple(tks))
    return Schedule(
        name=name,
        stages=S,
        chunks=M,
        steps=T,
        update_size=k,
        order=fields["order"],
        weights=fields["weights"],
        actions=tuple(actions),
        ticks=tuple(ticks) if with_ticks else None,
        virtual_stages=v,
        rank_order=tuple(rank_order) if virtual is not None else None,
        placement=placement,
        overlaps=tuple(overlaps),
    )


def _parse_pairs(no: int, body: str) -> list[tuple[int, Action, int, Action]]:
    out = []
    for tok in body.split():
        try:
            halves = [h.split(":") for h in tok.split("/")]
            (sa, a), (sb, b) = halves
            out.append((int(sa), parse_action(a), int(sb), parse_action(b)))
        except ValueError:
            raise ValueError(
                f"line {no}: bad overlapped pair {tok!r}; write stage:action/stage:action, "
                "e.g. 0:F3/3:B1"
            ) from None
    return out
