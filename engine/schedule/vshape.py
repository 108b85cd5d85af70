"""The multi-stage-per-rank families by their historical module: V-shaped and looped schedules.

Why this module is a face: its builders live where their concept is (ZB-V, DualPipeV and
looped BFS in :mod:`engine.schedule.vshape_orders`, V-Min and V-Half in
:mod:`engine.schedule.vblocks`), and the facts about every family are rows of the catalog
(:mod:`engine.schedule.catalog`). The names this module exported before stay importable:
the builders re-exported, and the per-module views it used to keep derived from the catalog.
"""

from __future__ import annotations

from engine.schedule.catalog import ROWS, family, lookup
from engine.schedule.ir import Schedule
from engine.schedule.vblocks import vhalf, vmin
from engine.schedule.vshape_orders import (
    dualpipev,
    dualpipev_rank_order,
    looped_bfs,
    looped_bfs_rank_order,
    zbv,
    zbv_rank_order,
)

__all__ = ["zbv", "dualpipev", "looped_bfs", "vmin", "vhalf", "zbv_rank_order",
           "dualpipev_rank_order", "looped_bfs_rank_order", "RANK_PROGRAMS",
           "TAKES_VIRTUAL_STAGES", "activation_bound", "rank_program"]

#: the rank-program families (catalog rows with a program builder)
RANK_PROGRAMS: tuple[str, ...] = tuple(f.name for f in ROWS if f.is_program)
#: the rank-program families whose stages per rank (v) the caller chooses
TAKES_VIRTUAL_STAGES: tuple[str, ...] = tuple(
    f.name for f in ROWS if f.is_program and f.takes_virtual_stages
)


def rank_program(
    name: str, ranks: int, chunks: int, steps: int = 1, virtual_stages: int | None = None
) -> Schedule:
    """The rank-program family ``name`` on ``ranks`` ranks (the catalog row's builder)."""
    return family(name).rank_program(ranks, chunks, steps, virtual_stages)


def activation_bound(name: str, stages: int, stage: int, chunks: int) -> int | None:
    """Micro-batches whose activations ``stage`` of a ``name`` program holds at most (the
    catalog row's bound; None for a name that is not a rank-program family)."""
    row = lookup(name)
    if row is None or not row.is_program:
        return None
    return row.activation_bound(stages, stage, chunks, None)
