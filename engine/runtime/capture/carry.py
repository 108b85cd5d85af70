"""What an asynchronous window carries across windows, and whether a capture can carry it.

Why: a synchronous step carries nothing from one step to the next (besides the fixed arena),
so it is captured as it is (:mod:`engine.runtime.capture.synchronous`). An asynchronous window -- one
``step()`` of pb, PipeDream or 2BW in steady state -- reads tensors that earlier windows made:
activations autograd saved for backwards that run now, activations and gradients waiting in
the mailboxes, earlier steps' targets. A CUDA graph reads the addresses its capture read, so
every such tensor must reach the graph through a fixed *slot* (docs/ALGORITHMS.md, "Capturing
whole step programs"). This module computes, from dispatch recordings of consecutive eager
windows (:class:`engine.runtime.capture.dispatch_trace.Recorder`), the plan a ring of slots must
follow, or why there is none:

* every tensor from outside the last window is either **static** (the same storage at the
  same operation in the window before: weights, gradients, optimizer state, flags) or
  **carried**: made by operation ``p`` of the window ``d`` windows back, and read at the
  same operation of the window before from the same ``p``, ``d`` windows back of *it*. A
  ring of depth ``max d`` holds them: a replay reads slot ``d`` of ``p``, and before the
  next replay the slots shift by one window (slot d <- slot d-1, slot 1 <- the window's
  own output of ``p``) -- shifting *before* a replay, not after, so that between replays
  every host object still names the value it named when the window was captured;
* anything else is a **problem** with its reason: an outside tensor whose origin moves
  between windows (a buffer that alternates, a tensor made at a different operation), an
  in-place write into a carried tensor (the replay would write the slot while the host
  keeps the value it named at capture), calls that differ, host reads.

The host side of the same question is :func:`host_affine`: a replay runs no Python, so every
counter the window's Python advances (ids, versions, update counts, dict keys) must advance
by the same amount in every window, or the host cannot be brought up to date after replays
without re-running it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

__all__ = ["Carried", "CarryPlan", "fingerprint", "host_affine", "plan_carry", "ring_depths"]


@dataclasses.dataclass(frozen=True)
class Carried:
    """One read of a carried tensor: operation ``op`` of the window (its access ``role``)
    reads the output made by operation ``producer`` of the window ``depth`` back."""

    op: int
    role: str
    depth: int
    producer: int
    nbytes: int
    #: which of the producer's outputs (its k-th tensor)
    out: int = 0


@dataclasses.dataclass
class CarryPlan:
    """The outside reads of one window, classified (module docstring)."""

    ops: int
    static: int
    staged: int
    carried: list[Carried]
    problems: list[str]
    host_reads: list[str]
    #: how many windows back the oldest batch the window reads was fed (a target read by the
    #: last stage of a later window): the staging buffers form a ring of this depth + 1
    staged_depth: int = 0
    #: windows per cycle: 1, or 2 when buffers alternate (one graph per window of the cycle)
    period: int = 1

    @property
    def depth(self) -> int:
        """The ring depth the window needs (0: it carries nothing)."""
        return max((c.depth for c in self.carried), default=0)

    @property
    def slots(self) -> int:
        """Distinct (depth, producer, output) carried reads."""
        return len({(c.depth, c.producer, c.out) for c in self.carried})

    @property
    def slot_bytes(self) -> int:
        """Bytes of the ring: each carried producer's output, once per window of depth."""
        seen: dict[tuple[int, int], tuple[int, int]] = {}
        for c in self.carried:
            d, n = seen.get((c.producer, c.out), (0, 0))
            seen[(c.producer, c.out)] = (max(d, c.depth), max(n, c.nbytes))
        return sum(d * n for d, n in seen.values())

    @property
    def capturable(self) -> bool:
        return not self.problems and not self.host_reads


def _origin(access: Any, earlier: Sequence[Any]) -> tuple[int, int] | None:
    """(depth, producing op) of an outside access, None when made before every recording.
    The most recent window that allocated the storage wins (addresses are reused)."""
    for d, rec in enumerate(reversed(earlier), start=1):
        p = rec.allocated.get(access.storage)
        if p is not None:
            return d, p
    return None


def _classify(access: Any, earlier: Sequence[Any]) -> tuple[str, Any]:
    origin = _origin(access, earlier)
    if origin is None:
        return "static", access.ptr
    return "carried", (origin, access.ptr - access.storage)


def plan_carry(
    recorders: Sequence[Any],
    *,
    staged: Callable[[Any, int], int | None] | None = None,
    tolerated: Callable[[Any], bool] | None = None,
    period: int = 1,
) -> CarryPlan:
    """The plan of the last of ``recorders`` (consecutive windows, oldest first): it is
    compared with the window ``period`` before it (1: every window the same; 2: windows
    alternate, as 2BW's double buffer and PipeDream's version slots do -- a cycle of two
    graphs), each against the windows before it.
    ``staged(access, w)``: how many windows before window ``w`` the batch the access reads
    was fed (0: its own; None: not a batch), read through staging buffers, not carried;
    ``tolerated(op)``: a host read that is not the
    window's (the CPU reference optimizer's ``found_inf`` read)."""
    if len(recorders) < 2 * period + 1:
        raise ValueError(f"plan_carry with period {period} needs at least {2 * period + 1} "
                         f"consecutive windows, got {len(recorders)}")
    last, before = len(recorders) - 1, len(recorders) - 1 - period
    L, P = recorders[last].ops, recorders[before].ops
    problems: list[str] = []
    if len(L) != len(P):
        problems.append(f"the window made {len(P)} calls, then {len(L)} ({period} later)")
    carried: list[Carried] = []
    static = n_staged = staged_depth = 0
    for a, b in zip(P, L, strict=False):
        if a.name != b.name or a.constants != b.constants:
            problems.append(f"op {b.index}: {a.name}({a.constants}) then {b.name}({b.constants})")
            break
        if len(a.accesses) != len(b.accesses):
            problems.append(f"op {b.index} {b.name}: other tensors than in the window before")
            break
        for x, y in zip(a.accesses, b.accesses, strict=True):
            if y.source is not None:
                continue  # made inside the window: the graph's pool
            age = staged(y, last) if staged is not None else None
            if age is not None:
                if x.source is not None or staged(x, before) != age:  # type: ignore[misc]
                    problems.append(f"op {b.index} {b.name} {y.role}: reads the batch of {age} "
                                    "window(s) back, which the window before did not")
                n_staged += 1
                staged_depth = max(staged_depth, age)
                continue
            kx = _classify(x, recorders[:before]) if x.source is None else ("inside", None)
            ky = _classify(y, recorders[:last])
            if kx != ky:
                problems.append(f"op {b.index} {b.name} {y.role}: origin moves between windows "
                                f"({_say(kx)}, then {_say(ky)})")
                continue
            if ky[0] == "static":
                static += 1
                continue
            (depth, producer), _ = ky[1]
            if y.write:
                problems.append(f"op {b.index} {b.name} writes in place into a tensor made "
                                f"{depth} window(s) back by op {producer} (a replay would write "
                                "the slot, not the tensor the host holds)")
            k, nbytes = _output(recorders[last - depth].ops[producer], y.storage)
            carried.append(Carried(b.index, y.role, depth, producer, nbytes, k))
    reads = [f"{op.name} {op.sync}, called from {op.where}" for op in L
             if op.sync is not None and not (tolerated is not None and tolerated(op))]
    return CarryPlan(len(L), static, n_staged, carried, problems, reads, staged_depth, period)


def _output(op: Any, storage: int) -> tuple[int, int]:
    """(index, bytes) of the output of ``op`` that allocated ``storage``."""
    for acc in op.accesses:
        if acc.storage == storage and acc.role.startswith("out:"):
            n = acc.dtype.itemsize
            for s in acc.shape:
                n *= s
            return int(acc.role[4:]), n
    return 0, 0


def _say(kind: tuple[str, Any]) -> str:
    if kind[0] == "static":
        return f"static at {kind[1]:#x}"
    if kind[0] == "inside":
        return "made inside the window"
    (d, p), off = kind[1]
    return f"made {d} window(s) back by op {p}" + (f" at offset {off}" if off else "")


# ---------------------------------------------------------------------- the host side

_PLAIN = (bool, str, type(None), float)
#: measurements, not state a replay must reproduce: per-stage busy time and the clock's log
#: of measured action durations (a replay is timed as one span)
#: (the stage streams' hand-over memory -- storages held until safe to free -- is device
#: memory bookkeeping, not the host's counters: engine.runtime.exec.streams)
MEASURED = frozenset({"busy_ns", "clock", "memory_held", "memory_ready", "memory_clean",
                      "memory_to_caller"})

#: modules of CPU stand-ins for the device (fingerprint leaves their objects opaque)
_DEVICE_STAND_INS = ("engine.testing", "engine.runtime.capture.graph_twin")


def fingerprint(root: Any) -> Any:
    """The host state reachable from ``root`` through engine objects, dicts, lists, tuples
    and sets, as nested tuples: ints as ("int", v) (the affine part), bools, floats,
    strings and None as ("const", v), tensors as ("tensor", shape, dtype) and any other
    object as ("opaque", type) (modules, optimizers, autograd nodes: not the host's
    counters). An engine object met twice is ("again", type); :data:`MEASURED` fields are
    left out."""
    seen: set[int] = set()

    def walk(v: Any) -> Any:
        if isinstance(v, bool) or isinstance(v, _PLAIN):
            return ("const", v)
        if isinstance(v, int):
            return ("int", v)
        if isinstance(v, Tensor):
            return ("tensor", tuple(v.shape), str(v.dtype))
        if isinstance(v, dict):
            items = sorted((("item", walk(k), walk(x)) for k, x in v.items()), key=_order)
            return ("dict", tuple(items))
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, tuple(walk(x) for x in v))
        if isinstance(v, (set, frozenset)):
            return ("set", tuple(sorted((walk(x) for x in v), key=_order)))
        mod = type(v).__module__ or ""
        # (the CPU stand-ins -- fake streams and events, graph twins -- are the device's,
        # not the host's bookkeeping, as torch.cuda.Event objects are)
        if not mod.startswith("engine.") or mod.startswith(_DEVICE_STAND_INS) or \
                callable(v) and not hasattr(v, "__dict__"):
            return ("opaque", type(v).__qualname__)
        if id(v) in seen:
            return ("again", type(v).__qualname__)
        seen.add(id(v))
        fields = dict(getattr(v, "__dict__", {}))
        for k in getattr(type(v), "__slots__", ()):
            if hasattr(v, k):
                fields[k] = getattr(v, k)
        return ("obj", type(v).__qualname__,
                tuple((k, walk(x)) for k, x in sorted(fields.items()) if k not in MEASURED))

    return walk(root)


def _order(item: Any) -> Any:
    """Sort key of a fingerprinted dict item (by its key) or set member: ints by value,
    tuples of ints (the executor's (stage, micro-batch) keys) by values, else by repr."""
    k = item[1] if item[:1] == ("item",) else item
    if k[:1] == ("int",):
        return (0, (k[1],), "")
    if k[:1] == ("tuple",) and all(x[:1] == ("int",) for x in k[1]):
        return (0, tuple(x[1] for x in k[1]), "")
    return (1, (), repr(k))


def host_affine(f0: Any, f1: Any, f2: Any, path: str = "host") -> tuple[int, list[str]]:
    """Compare three fingerprints of consecutive windows' host state: returns (how many
    ints advance, the reasons the state is not affine -- a shape that changes, a constant
    that changes, an int whose step differs between the two windows)."""
    problems: list[str] = []
    moving = 0

    def go(a: Any, b: Any, c: Any, where: str) -> None:
        nonlocal moving
        if len(problems) >= 8:
            return
        if not (isinstance(a, tuple) and isinstance(b, tuple) and isinstance(c, tuple)) or \
                a[:1] != b[:1] or b[:1] != c[:1]:
            problems.append(f"{where}: {_brief(a)}, {_brief(b)}, {_brief(c)}")
            return
        kind = a[0]
        if kind == "int":
            if b[1] - a[1] != c[1] - b[1]:
                problems.append(f"{where}: {a[1]}, {b[1]}, {c[1]} (steps differ)")
            moving += b[1] != a[1]
            return
        if kind in ("const", "opaque", "again", "tensor"):
            if not (a == b == c):
                problems.append(f"{where}: {_brief(a)}, {_brief(b)}, {_brief(c)}")
            return
        if kind == "obj":
            if a[1] != b[1] or b[1] != c[1] or [k for k, _ in a[2]] != [k for k, _ in b[2]] \
                    or [k for k, _ in b[2]] != [k for k, _ in c[2]]:
                problems.append(f"{where}: another object or other fields")
                return
            for (k, x), (_, y), (_, z) in zip(a[2], b[2], c[2], strict=True):
                go(x, y, z, f"{where}.{k}")
            return
        if kind == "item":
            go(a[1], b[1], c[1], f"{where}<key>")
            go(a[2], b[2], c[2], f"{where}<value>")
            return
        xs, ys, zs = a[-1], b[-1], c[-1]
        if not (len(xs) == len(ys) == len(zs)):
            problems.append(f"{where}: {len(xs)}, {len(ys)}, {len(zs)} entries")
            return
        for n, (x, y, z) in enumerate(zip(xs, ys, zs, strict=True)):
            go(x, y, z, f"{where}[{n}]")

    go(f0, f1, f2, path)
    return moving, problems


def _brief(v: Any) -> str:
    s = repr(v)
    return s if len(s) < 60 else s[:57] + "..."


def ring_depths(plan: CarryPlan) -> dict[tuple[int, int], int]:
    """(producer op, output) -> the deepest window back it is read from: the ring keeps that
    many slots of it (slot 1: the previous window's output, slot d: d windows back)."""
    out: dict[tuple[int, int], int] = {}
    for c in plan.carried:
        out[(c.producer, c.out)] = max(out.get((c.producer, c.out), 0), c.depth)
    return out
