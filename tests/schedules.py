"""The one registry of schedule families for tests: every subset a test parametrizes over.

Why one file (TDP keeps one registry too): a test that means "every synchronous family" and
writes ``["naive", "gpipe", "1f1b"]`` silently stops covering the family added next (zbh1 was
missed that way, in the engine as well). Each subset here is derived from the catalog
(engine/schedule/catalog.py), so a new row joins every test of its kind; a test that needs a
fixed list for a reason says so next to its literal.

Import as ``from schedules import SYNC, ASYNC, ...`` (tests/ is on ``sys.path``).
"""

from __future__ import annotations

from engine.schedule.catalog import FAMILIES, SCHEDULES

__all__ = [
    "ALL",
    "ASYNC",
    "FREE_UPDATE_SIZE",
    "LIVE_ASYNC",
    "SPLIT_BACKWARD",
    "STASHED",
    "SYNC",
    "SYNC_WHOLE_BACKWARD",
    "VARIANTS",
    "chunks_for",
    "variant",
]

#: every catalog family, in the documentation's order
ALL: tuple[str, ...] = SCHEDULES
#: flush every mini-batch: gradients equal an unpipelined model's
SYNC: tuple[str, ...] = tuple(n for n in ALL if FAMILIES[n].synchronous)
#: synchronous with whole backwards (no separate W): the families a chained backward serves
SYNC_WHOLE_BACKWARD: tuple[str, ...] = tuple(n for n in SYNC if not FAMILIES[n].split_backward)
#: never flush
ASYNC: tuple[str, ...] = tuple(n for n in ALL if not FAMILIES[n].synchronous)
#: asynchronous with weight versions (stash or 2bw): a forward's weights are kept for its B
STASHED: tuple[str, ...] = tuple(n for n in ASYNC if FAMILIES[n].weights != "live")
#: asynchronous with live weights: the weight mitigations apply
LIVE_ASYNC: tuple[str, ...] = tuple(n for n in ALL if FAMILIES[n].live_async)
#: any update size k >= 1 (the others update once per mini-batch)
FREE_UPDATE_SIZE: tuple[str, ...] = tuple(n for n in ALL if not FAMILIES[n].per_minibatch)
#: B computes the input gradient, a later W the weight gradient
SPLIT_BACKWARD: tuple[str, ...] = tuple(n for n in ALL if FAMILIES[n].split_backward)

#: every (family, order) the runtime runs, as test ids: the family's name for its default
#: order, "<family>-<order>" for the others (pb-1f1b)
VARIANTS: tuple[str, ...] = tuple(
    n if o == FAMILIES[n].default_order else f"{n}-{o}" for n in ALL for o in FAMILIES[n].orders
)


def variant(test_id: str) -> tuple[str, str | None]:
    """(schedule, order) of a :data:`VARIANTS` id; order None for the default."""
    name, _, order = test_id.partition("-")
    if name not in FAMILIES or (order and order not in FAMILIES[name].orders):
        raise ValueError(f"{test_id!r} is not a schedule variant; known: {', '.join(VARIANTS)}")
    return name, order or None


def chunks_for(name: str, stages: int, chunks: int) -> int:
    """``chunks``, raised to ``stages`` where the family needs M >= S (2bw)."""
    return max(chunks, stages) if FAMILIES[name].needs_chunks_ge_stages else chunks
