"""The catalog: every fact about each built-in schedule family, in one table.

Why one table: before it, "is this schedule synchronous", "which orders does it run in",
"2bw updates once per mini-batch and needs M >= S" and "how many weight versions does a
stage hold" were restated in the stream generator, the generators, the validator, the
analysis, the partitioner, the runtime and the command line -- and had started to drift.
Every module now asks :func:`family` and nothing else decodes a schedule name.

What a row holds (ALGORITHMS.md, "Schedules" and "Weight versions"):

* ``synchronous``: flushes at the end of every mini-batch, so D_s = 0 and the gradients
  equal an unpipelined model's;
* ``orders``: the orders the family runs in (the first is the default); ``pb`` runs in
  Kosson et al.'s ``dataflow`` ticks or PipeDream's ``1f1b`` alternation;
* ``weights``: the IR weight policy (``live``, ``stash`` or ``2bw``);
* ``per_minibatch``: the update size k is fixed to M (synchronous families and 2bw);
  otherwise k defaults to 1 and any k >= 1 is allowed;
* ``needs_chunks_ge_stages``: 2bw's M >= S (two weight versions suffice only then);
* ``split_backward``: B computes only the input gradient and a later W the weight gradient
  (zbh1);
* :meth:`Family.activation_bound` and :meth:`Family.weight_versions`: the per-stage memory
  footprint the validator, the partitioner and the runtime's memory tests rely on.

* :attr:`Family.live_async`: asynchronous with live weights (pb), the families the weight
  mitigations (prediction, discrepancy correction) apply to.

Not a row: ``interleaved`` (interleaved 1F1B, :mod:`engine.schedule.interleaved`). It is a
builder of one-mini-batch *programs* with v virtual stages per rank and a per-rank order, not
a family of open-ended per-stage streams: it has no ``generate``/stream form, no fixed order
or stage count for the rows' methods to answer for, and it needs ``virtual_stages``. Its name
lives in ``interleaved.NAME``; code outside ``schedule/`` compares with that constant.

Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine._checks import check_positive_int

__all__ = ["Family", "FAMILIES", "PROGRAM_FAMILIES", "SCHEDULES", "SYNCHRONOUS", "family"]


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
    #: the backward is split into B (input gradient) and W (weight gradient, run later)
    split_backward: bool = False

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

    def default_update_size(self, chunks: int) -> int:
        """k when the user gives none: M for per-mini-batch families, else 1."""
        return chunks if self.per_minibatch else 1

    def activation_bound(self, stages: int, stage: int, chunks: int, order: str | None) -> int:
        """Micro-batches whose activations ``stage`` holds at most (ALGORITHMS.md)."""
        S, s = stages, stage
        order = self.check_order(order)
        if self.name == "naive":
            return 1
        if self.name == "gpipe":
            return chunks
        if self.split_backward:  # deferred Ws keep activations: ZB-H1 holds 1f1b's peak S
            return min(chunks, S)
        if order == "dataflow":
            return 2 * (S - 1 - s) + 1
        if self.synchronous:  # a flushed mini-batch never has more than M in flight
            return min(chunks, S - s)
        return S - s

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


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("naive", True, ("naive",), "live", True, False,
               "model parallel: one micro-batch at a time through every stage"),
        Family("gpipe", True, ("fill-drain",), "live", True, False,
               "all forwards, all backwards, one update, flush"),
        Family("1f1b", True, ("1f1b",), "live", True, False,
               "PipeDream-Flush: warm-up, one forward one backward, flush"),
        Family("zbh1", True, ("zb-h1",), "live", True, False,
               "ZB-H1 zero bubble: 1f1b with the weight gradient W split off B and deferred",
               split_backward=True),
        Family("pipedream", False, ("1f1b",), "stash", False, False,
               "asynchronous 1F1B with weight stashing, never flushes"),
        Family("2bw", False, ("1f1b",), "2bw", True, True,
               "PipeDream-2BW: asynchronous 1F1B, a new weight version every mini-batch"),
        Family("pb", False, ("dataflow", "1f1b"), "live", False, False,
               "pipelined backpropagation: live weights, never flushes"),
    )
}

#: names of the built-in families, in the order the documentation lists them
SCHEDULES: tuple[str, ...] = tuple(FAMILIES)
#: the families that flush every mini-batch
SYNCHRONOUS: frozenset[str] = frozenset(n for n, f in FAMILIES.items() if f.synchronous)


def live_async(weights: str, synchronous: bool) -> bool:
    """Whether a schedule (a family or a hand-written program) reads live weights
    asynchronously: the staleness the weight mitigations (prediction, PipeMare's
    discrepancy correction) address."""
    return weights == "live" and not synchronous


def family(name: object) -> Family:
    """The catalog row of ``name``; a ValueError listing the known names otherwise."""
    fam = FAMILIES.get(name) if isinstance(name, str) else None
    if fam is None:
        raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}")
    return fam



#: families stated rank by rank (several stages per rank, generated as one-mini-batch programs
#: by engine.schedule.interleaved and engine.schedule.vshape; all synchronous, live weights,
#: k = M): name -> (stage placement, what it is)
PROGRAM_FAMILIES: dict[str, tuple[str, str]] = {
    "interleaved": ("round-robin, v per rank", "Megatron's interleaved 1F1B"),
    "zbv": ("V, 2 per rank", "zero-bubble V: B and W split, Ws fill the bubbles"),
    "dualpipev": ("V, 2 per rank", "DualPipeV: a forward overlapped with another's backward"),
    "looped_bfs": ("round-robin, v per rank", "breadth-first: all forwards stage by stage"),
}
