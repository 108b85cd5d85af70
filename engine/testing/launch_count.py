"""Aten calls per action of a pipeline step, and of a plain loop doing the same math.

Why: on a GPU at batch 1 a step costs what its launches cost (docs/design-notes.md has the
counts that started this). Counting aten calls that
launch a kernel (views, allocations and metadata excluded: :func:`dispatch_trace.is_view`)
with a dispatch mode works on a CPU, per action: the executor's action hook labels every call
with the forward, backward or update it belongs to, so a test can hold each phase to a budget
and name the calls that exceed it.

What the count cannot see (:mod:`engine.runtime.capture.dispatch_trace`): the C++ CPU SGD loop and
Triton kernels. :func:`count_pipeline_step` counts each call of the C++ loop as one
``<fused optimizer kernel>`` launch (on a GPU the same update is one fused Triton kernel per
flat bucket); plain momentum SGD runs torch ops on CPU, which are counted as they are.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from engine.runtime.capture.dispatch_trace import Recorder

__all__ = ["FUSED", "PHASES", "count_calls", "count_pipeline_step"]

#: F forward, B backward (W: split weight gradient), U update; "step": the step's own work
#: before its first action (splitting the inputs); "losses": the step's mean loss (and a
#: synchronous step's loss check)
PHASES = ("F", "B", "W", "U", "step", "losses")
#: the name a fused optimizer update (the C++ CPU loop) is counted under
FUSED = "<fused optimizer kernel>"


def count_calls(fn: Callable[[Recorder], Any]) -> dict[str, Counter[str]]:
    """Kernel-launching aten calls ``fn(recorder)`` makes, by the recorder's label (fn sets
    ``recorder.label`` to attribute what follows)."""
    rec = Recorder()
    rec.label = "step"
    with rec:
        fn(rec)
    out: dict[str, Counter[str]] = {}
    for op in rec.ops:
        if not op.view:
            out.setdefault(str(op.label), Counter())[op.name] += 1
    return out


def count_pipeline_step(pipe: Any, x: Any, y: Any) -> dict[str, Counter[str]]:
    """One ``pipe.step(x, y)``, its calls by action kind (keys of :data:`PHASES`); a call
    belongs to the action that ran last before it (an action's bookkeeping included)."""
    from engine.optim import cpu_loop

    ex = pipe.parts.executor
    old = ex.action_hook
    native = cpu_loop._native()
    fused: Counter[str] = Counter()

    def counted(*args: Any, **kwargs: Any) -> Any:
        fused[FUSED] += 1
        return native(*args, **kwargs)

    def run(rec: Recorder) -> None:
        def hook(stage: int, kind: str, mb: int) -> None:
            rec.label = kind
            if old is not None:
                old(stage, kind, mb)

        take = ex._take_losses

        def losses(*args: Any, **kwargs: Any) -> Any:
            rec.label = "losses"
            return take(*args, **kwargs)

        ex.action_hook = hook
        ex._take_losses = losses
        if native is not None:
            cpu_loop._step = counted
        try:
            pipe.step(x, y)
        finally:
            ex.action_hook = old
            del ex._take_losses  # the class's method again
            if native is not None:
                cpu_loop._step = native

    counts = count_calls(run)
    if fused:
        counts.setdefault("U", Counter()).update(fused)
    return counts
