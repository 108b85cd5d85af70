"""The ring an asynchronous window needs, measured on a CPU.

Why: capturing an asynchronous window (pb, PipeDream, 2BW) needs static slots for every
tensor it carries across windows and a host state that advances by the same amount at every
window (engine.runtime.capture.carry). :func:`plan_pipeline` runs a pipeline's steady state eagerly
for a few windows under dispatch recorders and returns the plan for its last window: what is
static, what is carried and how many windows back, what must be staged, the host reads, and
whether the host counters are affine -- or every reason a capture cannot hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from engine.runtime.capture.carry import CarryPlan, fingerprint, host_affine, plan_carry
from engine.runtime.capture.audit import _leaves, _reference_optimizer
from engine.runtime.capture.dispatch_trace import Recorder

__all__ = ["REFERENCE_SKIP", "WindowPlan", "plan_pipeline"]

#: the CPU reference optimizer's found_inf read (the fused CUDA kernels read it on the device)
REFERENCE_SKIP = "engine/optim/functional.py:_skip"


@dataclasses.dataclass
class WindowPlan:
    carry: CarryPlan
    #: host ints the window advances (ids, versions, counts: what a replay must add)
    host_moving: int
    #: why the host state is not affine (empty: it is)
    host_problems: list[str]

    @property
    def capturable(self) -> bool:
        return self.carry.capturable and not self.host_problems

    def describe(self) -> str:
        c = self.carry
        lines = [f"{c.ops} ops; static {c.static}, staged {c.staged} (batches up to "
                 f"{c.staged_depth} windows back), carried {len(c.carried)} reads of {c.slots} "
                 f"tensors up to {c.depth} windows back ({c.slot_bytes} bytes of ring); host: "
                 f"{self.host_moving} counters advance"]
        lines += [f"  problem: {p}" for p in c.problems[:5]]
        lines += [f"  host read: {r}" for r in c.host_reads[:3]]
        lines += [f"  host: {p}" for p in self.host_problems[:5]]
        return "\n".join(lines)


def plan_pipeline(
    make: Callable[[], Any],
    batches: Sequence[tuple[Any, Any]],
    *,
    warmup: int = 6,
    windows: int = 6,
    before_window: Callable[[Any, int], None] | None = None,
) -> WindowPlan:
    """Fill ``make()``'s pipeline with ``warmup`` steps (enough for the step compiler to find
    its period: 2BW's takes five), then record ``windows`` steps and
    plan the last (module docstring): as a cycle of one window, else (with at least 6
    windows) of two; the first plan that holds, else the one-window plan with its reasons. ``before_window(pipe, w)`` runs before
    recorded window w (tests break a precondition with it)."""
    if len(batches) < warmup + windows:
        raise ValueError(f"plan_pipeline needs {warmup + windows} batches, got {len(batches)}")
    with _reference_optimizer():
        pipe = make()
        for x, y in batches[:warmup]:
            pipe.step(x, y)
        recorders, prints = [], []
        for w in range(windows):
            if before_window is not None:
                before_window(pipe, w)
            x, y = batches[warmup + w]
            rec = Recorder()
            with rec:
                pipe.step(x, y)
            recorders.append(rec)
            prints.append(fingerprint(pipe.parts.executor))
    spans = [[(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in _leaves(b)]
             for b in batches[warmup:warmup + windows]]

    def staged(access: Any, w: int) -> int | None:
        for age in range(w + 1):
            if any(lo <= access.ptr < lo + n for lo, n in spans[w - age]):
                return age
        return None

    plans = []
    for period in (1, 2):
        if windows < 2 * period + 2:  # the compared window needs 2 before it
            break
        carry = plan_carry(recorders, staged=staged, period=period,
                           tolerated=lambda op: op.where == REFERENCE_SKIP)
        moving, problems = host_affine(*prints[-1 - 2 * period::period], path="executor")
        plans.append(WindowPlan(carry, moving, problems))
        if plans[-1].capturable or carry.host_reads:
            break
    return plans[0] if not plans[-1].capturable else plans[-1]
