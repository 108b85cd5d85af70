"""Fault injection: make a pipeline fail before a chosen action, to test what it leaves behind.

Why in the library: "an exception anywhere inside ``step()`` leaves every stage consistent"
is a promise about every point of every schedule, so the tests walk a failure across every
action index of a step. :class:`FaultInjector` hooks the executor's action loop (the hook runs
between actions, where a deferred Ctrl-C is also delivered) and raises before the
``at``-th action it sees, counting from when it was installed; ``actions`` records what it saw,
so a test can say which action it interrupted.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FaultInjector", "InjectedFault"]


class InjectedFault(RuntimeError):
    """The failure a :class:`FaultInjector` raises by default."""


class FaultInjector:
    """Context manager raising ``exc`` before the ``at``-th action of ``pipe`` (0-based).

    ``exc``: an exception class or instance (e.g. ``KeyboardInterrupt``); ``at=None`` only
    records the actions. Example::

        with FaultInjector(pipe, at=7) as faults:
            with pytest.raises(InjectedFault):
                pipe.step(x, y)
        stage, kind, microbatch = faults.actions[7]
    """

    def __init__(
        self, pipe: Any, at: int | None, exc: type[BaseException] | BaseException = InjectedFault
    ) -> None:
        self.pipe = pipe
        self.at = at
        self.exc = exc
        self.actions: list[tuple[int, str, int]] = []
        self.fired = False

    def _hook(self, stage: int, kind: str, microbatch: int) -> None:
        index = len(self.actions)
        self.actions.append((stage, kind, microbatch))
        if self.at is not None and index == self.at and not self.fired:
            self.fired = True
            exc = self.exc
            if isinstance(exc, type):
                exc = exc(
                    f"injected before action {index} (stage {stage}, {kind} of micro-batch "
                    f"{microbatch})"
                )
            raise exc

    def __enter__(self) -> FaultInjector:
        ex = self.pipe.parts.executor
        if ex.action_hook is not None:
            raise RuntimeError("a FaultInjector is already installed on this pipeline")
        ex.action_hook = self._hook
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.pipe.parts.executor.action_hook = None
