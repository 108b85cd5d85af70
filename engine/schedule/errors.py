"""The one exception type every schedule check raises.

Why its own type: callers (the runtime before it starts, tests that hand-make bad schedules)
need to tell "this schedule is wrong" from programming errors, and to point at the exact
action. ``ScheduleError`` is a ``ValueError`` carrying ``stage``, ``index`` and ``action``
so a message like "stage 1, action 4 (B3): backward before its forward F3" can also be
inspected programmatically.
"""

from __future__ import annotations

from engine.schedule.ir import Action


class ScheduleError(ValueError):
    """A schedule violates a rule; ``stage``/``index``/``action`` locate the offending action."""

    def __init__(
        self,
        message: str,
        *,
        stage: int | None = None,
        index: int | None = None,
        action: Action | None = None,
    ) -> None:
        self.stage = stage
        self.index = index
        self.action = action
        if stage is not None and index is not None and action is not None:
            message = f"stage {stage}, action {index} ({action}): {message}"
        elif stage is not None:
            message = f"stage {stage}: {message}"
        super().__init__(message)
