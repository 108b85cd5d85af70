"""The catalog: one row per built-in schedule family, and the only place a family name is read.

Why one table: "is this schedule synchronous", "which orders does it run in", "how many
stages does a rank hold", "which function generates it", "how many activations does a stage
keep" were once answered by five registries (two tables here, two tuples and a constant beside
the generators) and name chains in the stream generator, the resolver and the runtime -- and
the API, the command line and the docs listed different names. Every module now asks
:func:`family` (or :func:`lookup`) and reads the row; nothing else compares a family name
(tests/test_layout.py checks it).

What a row holds (ALGORITHMS.md, "Schedules" and "Weight versions"):

* ``synchronous``: flushes at the end of every mini-batch, so D_s = 0 and the gradients
  equal an unpipelined model's;
* ``orders``: the orders the family runs in (the first is the default); ``pb`` runs in
  Kosson et al.'s ``dataflow`` ticks or PipeDream's ``1f1b`` alternation. A rank program's
  order is its own name;
* ``weights``: the IR weight policy (``live``, ``stash`` or ``2bw``);
* ``per_minibatch``: the update size k is fixed to M (synchronous families and 2bw);
  otherwise k defaults to 1 and any k >= 1 is allowed;
* ``needs_chunks_ge_stages``: 2bw's M >= S (two weight versions suffice only then);
* ``split_backward``: B computes only the input gradient and a later W the weight gradient;
* ``placement``: which rank holds which stage (:class:`Placement`: one per rank, the V with
  two per rank, or round-robin with v per rank, v the caller's ``virtual_stages``);
* the generator: ``streams`` (per-stage open-ended streams, one compute order per entry of
  ``orders``, :mod:`engine.schedule.orders`) or ``program`` (a builder of one-mini-batch
  programs stated rank by rank, with each rank's order);
* ``bound``: the most micro-batches whose activations a stage holds
  (:meth:`Family.activation_bound`; None where no closed form is checked);
  :meth:`Family.weight_versions`: the weight versions it keeps. The validator, the
  partitioner and the runtime's memory tests rely on both.

:attr:`Family.live_async`: asynchronous with live weights (pb), the families the weight
mitigations (prediction, discrepancy correction) apply to.

Importing this module does not import torch.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

from engine._checks import check_positive_int
from engine.schedule import orders
from engine.schedule.interleaved import interleaved
from engine.schedule.ir import Schedule
from engine.schedule.vblocks import vhalf_block, vmin_block, block_peak, vhalf, vmin
from engine.schedule.vshape_orders import dualpipev, looped_bfs, zbv

__all__ = [
    "FAMILIES",
    "Family",
    "NAMES",
    "Placement",
    "ROWS",
    "SCHEDULES",
    "SYNCHRONOUS",
    "family",
    "live_async",
    "lookup",
    "unknown_schedule",
]


@dataclass(frozen=True)
class Placement:
    """Which rank holds which stage; ``per_rank`` None: v stages each, v chosen by the caller."""

    label: str
    per_rank: int | None
    rule: str


ONE_PER_RANK = Placement("one per rank", 1, "stage s on rank s")
V_SHAPE = Placement("V, 2 per rank", 2, "rank r holds stages r and 2R-1-r")
ROUND_ROBIN = Placement("round-robin, v per rank", None, "rank r holds r, r+R, r+2R, ...")

#: the activation bound of a stage: (stages S, stage s, chunks M, order) -> micro-batches
Bound = Callable[[int, int, int, str], int]
#: a rank-program builder: (ranks, chunks, steps) or, round-robin, (ranks, v, chunks, steps)
Builder = Callable[..., Schedule]


@dataclass(frozen=True)
class Family:
    """One built-in schedule family (see the module docstring for the fields)."""

    name: str
    synchronous: bool
    orders: tuple[str, ...]
    weights: str
    per_minibatch: bool
    needs_chunks_ge_stages: bool
    summary: str
    split_backward: bool = False
    placement: Placement = ONE_PER_RANK
    #: one compute order per entry of ``orders`` (stream families); empty for rank programs
    streams: tuple[orders.Compute, ...] = ()
    #: the one-mini-batch program builder (rank programs); None for stream families
    program: Builder | None = None
    bound: Bound | None = None

    @property
    def is_program(self) -> bool:
        """Stated rank by rank as a finite program (else: open-ended per-stage streams)."""
        return self.program is not None

    @property
    def takes_virtual_stages(self) -> bool:
        """The caller chooses v, the stages per rank (``virtual_stages``)."""
        return self.placement.per_rank is None

    @property
    def live_async(self) -> bool:
        """Asynchronous with live weights: the weight mitigations apply (module docstring)."""
        return live_async(self.weights, self.synchronous)

    @property
    def default_order(self) -> str:
        return self.orders[0]

    def check_order(self, order: str | None) -> str:
        """The order to run in (``None``: the default); a clear error for a foreign one."""
        if order is None:
            return self.default_order
        if order not in self.orders:
            if self.is_program:
                raise ValueError(f"schedule {self.name!r} runs in its own order, not {order!r}")
            hint = (
                " (only pb chooses between 'dataflow' and '1f1b')"
                if len(self.orders) == 1
                else ""
            )
            raise ValueError(
                f"schedule {self.name!r} runs in order "
                f"{' or '.join(map(repr, self.orders))}, not {order!r}; leave order unset{hint}"
            )
        return order

    def compute(self, order: str | None) -> orders.Compute:
        """The per-stage compute order of a stream family in ``order``."""
        if self.is_program:
            raise ValueError(
                f"schedule {self.name!r} is stated rank by rank ({self.placement.label}), not as "
                "per-stage streams; build its program (engine.schedule.generate or "
                "Family.program_for)"
            )
        return self.streams[self.orders.index(self.check_order(order))]

    def default_update_size(self, chunks: int) -> int:
        """k when the user gives none: M for per-mini-batch families, else 1."""
        return chunks if self.per_minibatch else 1

    def activation_bound(
        self, stages: int, stage: int, chunks: int, order: str | None
    ) -> int | None:
        """Micro-batches whose activations ``stage`` holds at most (ALGORITHMS.md); None
        where the family states no closed form (interleaved)."""
        order = self.check_order(order)
        return None if self.bound is None else self.bound(stages, stage, chunks, order)

    def weight_versions(self, stages: int, stage: int) -> int:
        """Weight versions ``stage`` keeps at its peak, live included (ALGORITHMS.md): S-s
        for weight stashing, 2 for 2bw, 1 for live-weight families (a transient prediction
        or correction buffer of the mitigations comes on top, see the runtime)."""
        if self.weights == "stash":
            return stages - stage
        if self.weights == "2bw":
            return 2
        return 1

    def check(
        self, stages: int, chunks: int, update_size: int | None, *, check_chunks: bool = True
    ) -> int:
        """Validate S, M and k for this family; returns k (the default when None).

        ``check_chunks=False`` skips 2bw's M >= S (the open-ended streams can be generated
        for any M; the generators, the partitioner and the pipeline require it)."""
        S = check_positive_int("stages", stages, "a pipeline needs at least one stage")
        M = check_positive_int("chunks", chunks, "a mini-batch needs at least one micro-batch")
        if update_size is None:
            k = self.default_update_size(M)
        else:
            k = check_positive_int(
                "update_size", update_size, "an update applies at least one gradient"
            )
            if self.per_minibatch and k != M:
                raise ValueError(
                    f"{self.name!r} updates once per mini-batch, so update_size must equal "
                    f"chunks (M={M}), got {k}; drop update_size (or change chunks), or use "
                    "'pipedream'/'pb' for other update sizes"
                )
        if check_chunks and self.needs_chunks_ge_stages and M < S:
            raise ValueError(
                f"{self.name} needs chunks >= stages (M >= S), got M={M} < S={S}: with fewer "
                "micro-batches per mini-batch than stages, a forward would need a weight "
                f"version that is not yet produced and two versions would not suffice. Use "
                f"chunks >= {S}, or schedule 'pipedream' (weight stashing) for small M"
            )
        return k

    def rank_program(
        self, ranks: int, chunks: int, steps: int = 1, virtual_stages: int | None = None
    ) -> Schedule:
        """The program on ``ranks`` ranks (``virtual_stages``, default 2, only where the
        family takes it)."""
        if self.program is None:
            raise ValueError(f"schedule {self.name!r} is a per-stage stream family, not a program")
        if self.takes_virtual_stages:
            v = 2 if virtual_stages is None else virtual_stages
            return self.program(ranks, v, chunks, steps)
        if virtual_stages not in (None, self.placement.per_rank):
            raise ValueError(
                f"{self.name!r} places exactly {self.placement.per_rank} stages per rank; drop "
                f"virtual_stages={virtual_stages!r}"
            )
        return self.program(ranks, chunks, steps)

    def program_for(
        self,
        stages: int,
        chunks: int | None,
        *,
        steps: int = 1,
        update_size: int | None = None,
        order: str | None = None,
        virtual_stages: int | None = None,
    ) -> Schedule:
        """The program over ``stages`` stage modules, checking the pipeline's options: k = M,
        no foreign order, v (round-robin: required, >= 2, dividing ``stages``; the V: 2)."""
        name = self.name
        if self.program is None:
            raise ValueError(f"schedule {name!r} is a per-stage stream family, not a program")
        if self.takes_virtual_stages:
            v = virtual_stages
            if v is None:
                raise ValueError(
                    f"schedule={name!r} needs virtual_stages=v (stage modules per rank, >= 2)"
                )
            if isinstance(v, bool) or not isinstance(v, int) or v < 2 or stages % v:
                raise ValueError(
                    f"virtual_stages={v!r} must be an int >= 2 dividing the number of stage "
                    f"modules ({stages}): the modules are the ranks * v virtual stages"
                )
        else:
            v = self.placement.per_rank
            if virtual_stages not in (None, v):
                raise ValueError(
                    f"{name!r} places exactly {v} stages per rank; drop "
                    f"virtual_stages={virtual_stages!r}"
                )
            if stages % v:
                raise ValueError(
                    f"{name!r} places {v} stages per rank ({self.placement.rule}): the number "
                    f"of stage modules must be a multiple of {v}, got {stages}"
                )
        if chunks is None:
            raise ValueError(f"schedule={name!r} needs chunks=M (micro-batches per step)")
        if update_size not in (None, chunks):
            raise ValueError(
                f"{name!r} updates once per mini-batch, so update_size must equal chunks "
                f"(M={chunks}), got {update_size}; drop update_size"
            )
        self.check_order(order)
        return self.rank_program(stages // v, chunks, steps, v if self.takes_virtual_stages else None)


def live_async(weights: str, synchronous: bool) -> bool:
    """Whether a schedule (a family or a hand-written program) reads live weights
    asynchronously: the staleness the weight mitigations (prediction, PipeMare's
    discrepancy correction) address."""
    return weights == "live" and not synchronous


# ----------------------------------------------------------------------------- activation bounds
# (S stages, stage s, M micro-batches, order): ALGORITHMS.md, "Activation memory"


def _one(S: int, s: int, M: int, order: str) -> int:
    return 1


def _all_chunks(S: int, s: int, M: int, order: str) -> int:
    return M


def _flushed(S: int, s: int, M: int, order: str) -> int:
    return min(M, S - s)  # a flushed mini-batch never has more than M in flight


def _until_w(S: int, s: int, M: int, order: str) -> int:
    return min(M, S)  # deferred Ws keep activations: ZB-H1 holds 1f1b's peak S


def _steady(S: int, s: int, M: int, order: str) -> int:
    return 2 * (S - 1 - s) + 1 if order == "dataflow" else S - s


def _block(block: Callable[..., tuple[int, int, int, int]]) -> Bound:
    def bound(S: int, s: int, M: int, order: str) -> int:
        return min(M, block_peak(block, S // 2, M))  # a stage holds at most its rank's peak

    return bound


ROWS: tuple[Family, ...] = (
    Family("naive", True, ("naive",), "live", True, False,
           "model parallel: one micro-batch at a time through every stage",
           streams=(orders.one_at_a_time,), bound=_one),
    Family("gpipe", True, ("fill-drain",), "live", True, False,
           "all forwards, all backwards, one update, flush",
           streams=(orders.fill_drain,), bound=_all_chunks),
    Family("1f1b", True, ("1f1b",), "live", True, False,
           "PipeDream-Flush: warm-up, one forward one backward, flush",
           streams=(orders.one_f_one_b,), bound=_flushed),
    Family("zbh1", True, ("zb-h1",), "live", True, False,
           "ZB-H1 zero bubble: 1f1b with the weight gradient W split off B and deferred",
           split_backward=True, streams=(orders.zero_bubble_h1,), bound=_until_w),
    Family("interleaved", True, ("interleaved",), "live", True, False,
           "Megatron's interleaved 1F1B", placement=ROUND_ROBIN, program=interleaved),
    Family("looped_bfs", True, ("looped_bfs",), "live", True, False,
           "breadth-first: all forwards stage by stage", placement=ROUND_ROBIN,
           program=looped_bfs, bound=_all_chunks),
    Family("zbv", True, ("zbv",), "live", True, False,
           "zero-bubble V: B and W split, Ws fill the bubbles", split_backward=True,
           placement=V_SHAPE, program=zbv, bound=_flushed),
    Family("vhalf", True, ("vhalf",), "live", True, False,
           "V-Half: the V from a block of half 1F1B's activation lifespan", split_backward=True,
           placement=V_SHAPE, program=vhalf, bound=_block(vhalf_block)),
    Family("vmin", True, ("vmin",), "live", True, False,
           "V-Min: the V from the block of least lifespan, a third of 1F1B's activations",
           split_backward=True, placement=V_SHAPE, program=vmin, bound=_block(vmin_block)),
    Family("dualpipev", True, ("dualpipev",), "live", True, False,
           "DualPipeV: a forward overlapped with another's backward", split_backward=True,
           placement=V_SHAPE, program=dualpipev, bound=_flushed),
    Family("pipedream", False, ("1f1b",), "stash", False, False,
           "asynchronous 1F1B with weight stashing, never flushes",
           streams=(orders.steady_1f1b,), bound=_steady),
    Family("2bw", False, ("1f1b",), "2bw", True, True,
           "PipeDream-2BW: asynchronous 1F1B, a new weight version every mini-batch",
           streams=(orders.steady_1f1b,), bound=_steady),
    Family("pb", False, ("dataflow", "1f1b"), "live", False, False,
           "pipelined backpropagation: live weights, never flushes",
           streams=(orders.dataflow, orders.steady_1f1b), bound=_steady),
)

_BY_NAME: dict[str, Family] = {f.name: f for f in ROWS}

#: every built-in family, in the order the API, the command line and the docs list them
NAMES: tuple[str, ...] = tuple(_BY_NAME)
# Derived views kept for their importers; each is a filter of ROWS.
#: the per-stage stream families, in catalog order
FAMILIES: dict[str, Family] = {f.name: f for f in ROWS if not f.is_program}
#: their names
SCHEDULES: tuple[str, ...] = tuple(FAMILIES)
#: the stream families that flush every mini-batch
SYNCHRONOUS: frozenset[str] = frozenset(n for n, f in FAMILIES.items() if f.synchronous)


def unknown_schedule(name: object, also: tuple[str, ...] = (), note: str = "") -> str:
    """The one message for a name that is not a family: every family in catalog order, the
    other names the caller accepts (``also``, e.g. 'auto') and what else it takes (``note``),
    and the closest names when some are close."""
    close = (
        difflib.get_close_matches(name, NAMES + also, n=2, cutoff=0.6)
        if isinstance(name, str) else []
    )
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    more = f" (or {', '.join(map(repr, also))})" if also else ""
    more += f"; {note}" if note else ""
    return f"unknown schedule {name!r}; known schedules: {', '.join(NAMES)}{more}{hint}"


def lookup(name: object) -> Family | None:
    """The row of ``name``, or None when it is not a built-in family's name."""
    return _BY_NAME.get(name) if isinstance(name, str) else None


def family(name: object) -> Family:
    """The catalog row of ``name``; a ValueError naming every known family otherwise."""
    row = lookup(name)
    if row is None:
        raise ValueError(unknown_schedule(name))
    return row
