"""The one exception type every schedule check raises (defined in :mod:`engine.errors`).

Why its own type: callers (the runtime before it starts, tests that hand-make bad schedules)
need to tell "this schedule is wrong" from programming errors, and to point at the exact
action: ``ScheduleError`` is a ``ValueError`` carrying ``stage``, ``index`` and ``action``.
"""

from __future__ import annotations

from engine.errors import ScheduleError

__all__ = ["ScheduleError"]
