"""Schedule names the runtime accepts, and SpecTrain's prediction horizons.

The per-stage action streams the runtime executes are the schedule IR's
(:func:`engine.schedule.stage_actions`), and the delays D_s come from the IR's analysis
(:func:`engine.schedule.schedule_delays`): there is no second definition here.
"""

from __future__ import annotations

__all__ = ["SYNC_SCHEDULES", "ASYNC_SCHEDULES", "SCHEDULES", "spectrain_horizons"]

SYNC_SCHEDULES = ("naive", "gpipe", "1f1b")
ASYNC_SCHEDULES = ("pipedream", "2bw", "pb")
SCHEDULES = SYNC_SCHEDULES + ASYNC_SCHEDULES


def spectrain_horizons(s: int, S: int) -> tuple[int, int]:
    """SpecTrain's (s_F, s_B) for stage s of S (paper version; stage index plays GPU k)."""
    return s // 2 + S - s - 1, s // 2
