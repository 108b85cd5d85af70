"""The multi-stage-per-rank families by their historical module: V-shaped and looped schedules.

Why this module is a face: its builders live where their concept is (ZB-V, DualPipeV and
looped BFS in :mod:`engine.schedule.vshape_orders`, V-Min and V-Half in
:mod:`engine.schedule.vblocks`), and the facts about every family are rows of the one
registry, :mod:`engine.schedule.catalog`; this module only re-exports the builders.
"""

from __future__ import annotations

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
           "dualpipev_rank_order", "looped_bfs_rank_order"]
