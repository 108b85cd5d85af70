"""On-chip weights: the persisting-L2 set-aside of a GPU split across the stages on it.

Why the runtime does this and not each stage: the set-aside (cudaLimitPersistingL2CacheSize)
is device-wide. A stage asking for its own (``WeightArena.set_l2_persistence``) overwrites
the others' -- the last one wins -- and clearing one clears all. So the pipeline sets it once,
to the sum of the stages' shares, and each stage sets only an access-policy window over its
live weights on its own stage stream, marking at most its share persisting (hitRatio = share /
window), so that the windows together never hold more persisting lines than the set-aside.

The split is :func:`split_budget` (pure, tested on CPU): proportional to what each stage can
keep (its largest bucket -- a stream has one window -- capped by the device's maximum window),
and never more than that. On CPU, or where the device or the build cannot persist, nothing
is set and :attr:`L2State.reason` says why: the option is reported unsupported, never faked.
"""

from __future__ import annotations

import inspect
import os
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import PipelineConfigError

__all__ = ["L2State", "apply_l2", "check_l2_option", "split_budget"]


def check_l2_option(value: object) -> float:
    """The fraction of the device's persisting L2 that ``l2_persistence`` asks for (0: off)."""
    if value is None or value is False:
        return 0.0
    if value is True:
        return 1.0
    if isinstance(value, (int, float)) and 0.0 < float(value) <= 1.0:
        return float(value)
    raise PipelineConfigError(
        f"l2_persistence={value!r} must be False, True (the device's whole persisting L2) or "
        "a fraction in (0, 1] of it, e.g. l2_persistence=0.5"
    )


def split_budget(budget: int, sizes: Sequence[int]) -> list[int]:
    """Bytes of a ``budget`` for each of ``sizes`` (the bytes each stage can keep): shares
    proportional to the sizes, each capped by its size, rounded down (so they never sum to
    more than the budget). A budget that covers every size gives each its size."""
    if any(s < 0 for s in sizes) or budget < 0:
        raise ValueError(f"sizes and budget must be >= 0, got budget={budget}, sizes={list(sizes)}")
    total = sum(sizes)
    if budget == 0 or total == 0:
        return [0] * len(sizes)
    if budget >= total:
        return list(sizes)
    return [budget * s // total for s in sizes]


@dataclass
class L2State:
    """What a pipeline's stages got (``Pipeline.stats()``): ``granted`` bytes per stage,
    the ``set_aside`` the device reports holding (at least the sum of ``granted``: devices
    round the set-aside up to their granularity), its ``max_persisting`` size, and
    ``reason`` (empty when every stage with weights got a window)."""

    requested: float
    granted: list[int]
    set_aside: int = 0
    max_persisting: int = 0
    reason: str = ""
    windows: dict[int, Any] = field(default_factory=dict)  # stage position -> refresh()

    def stats(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "set_aside_bytes": self.set_aside,
            "max_persisting_bytes": self.max_persisting,
            "reason": self.reason,
        }


def _user_level() -> int:
    """The ``stacklevel`` of the first caller outside ``engine/runtime``, for a warning raised
    by this helper's caller: it points at the ``Pipeline(...)`` line however many builder
    frames lie between (a fixed count breaks whenever the build is reshaped)."""
    import engine.runtime

    root = os.path.dirname(os.path.abspath(engine.runtime.__file__)) + os.sep
    here = inspect.currentframe()
    frame = here.f_back if here is not None else None  # the warning's caller: level 1
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame = frame.f_back
        level += 1
    return level


def _unsupported(state: L2State, reason: str, *, warn: bool) -> L2State:
    state.granted = [0] * len(state.granted)
    state.reason = reason
    if warn:
        # A warning, not an error: the same training script runs in CPU CI and on a GPU.
        warnings.warn(f"l2_persistence is unsupported here: {reason}", stacklevel=_user_level())
    return state


def apply_l2(stages: Sequence[Any], streams: Any, fraction: float, owner: object) -> L2State:
    """Split the persisting L2 of the stages' GPU and set each stage's window on its stage
    stream; the set-aside and the windows are given back when ``owner`` is collected."""
    state = L2State(requested=fraction, granted=[0] * len(stages))
    if fraction == 0.0:
        state.reason = "off (l2_persistence=False)"
        return state
    if not streams.cuda:
        devices = sorted({str(p.device) for st in stages for p in st.store.params}) or ["cpu"]
        return _unsupported(
            state,
            f"the stages run on {', '.join(devices)}; L2 persistence needs CUDA stages "
            "(nothing was set, nothing is faked)",
            warn=True,
        )
    from engine.arena import l2 as arena_l2

    device = streams.device.index
    if device is None:
        import torch

        device = torch.cuda.current_device()
    limits = arena_l2.device_limits(device)
    state.max_persisting = int(limits["max_persisting_bytes"])
    if not limits["supported"] or limits["reason"]:
        return _unsupported(state, str(limits["reason"]), warn=True)
    max_window = int(limits["max_window_bytes"])
    # what a stage can keep: the bucket its window covers (the largest), up to a window
    arenas = [st.store.arena for st in stages]
    sizes = [
        0 if a is None else min(max_window, max(b.nbytes for b in a.buckets)) for a in arenas
    ]
    shares = split_budget(int(fraction * state.max_persisting), sizes)
    if sum(shares) == 0:
        return _unsupported(state, "no stage has weights to keep in L2", warn=False)
    got = arena_l2.set_aside(device, sum(shares))
    if not got["ok"]:
        return _unsupported(state, str(got["reason"]), warn=True)
    # What the device holds now. It may differ from the request either way: rounded down
    # (less than asked: the shares are split again) or up to its allocation granularity (a
    # small request is granted megabytes: the shares stay as asked, and the set-aside
    # reported is the device's).
    granted = int(got["granted_bytes"])
    if granted < sum(shares):
        shares = split_budget(granted, shares)
    reasons = []
    for i, (st, share) in enumerate(zip(stages, shares, strict=True)):
        if share == 0:
            continue
        stream = streams.streams[st.index]
        arena = st.store.arena

        def refresh(arena: Any = arena, share: int = share, stream: Any = stream) -> Any:
            return arena.set_l2_window(share_bytes=share, stream=stream)

        r = refresh()
        if r.ok:
            state.granted[i] = share
            state.windows[i] = refresh
            # the window covers live's address: set it again when live moves (swap_live)
            st.store.on_live_moved = refresh
        else:
            reasons.append(f"stage {st.index}: {r.reason}")
    state.set_aside = granted
    if sum(state.granted) < sum(shares):  # give back what failed windows would have used
        if sum(state.granted):
            again = arena_l2.set_aside(device, sum(state.granted))
            state.set_aside = int(again["granted_bytes"]) if again["ok"] else granted
        else:
            arena_l2.reset(device)
            state.set_aside = 0
    state.reason = "; ".join(reasons)
    if reasons:
        warnings.warn(f"l2_persistence: {state.reason}", stacklevel=_user_level())
    if state.set_aside:
        held = [streams.streams[stages[i].index] for i in state.windows]
        weakref.finalize(owner, _give_back, device, held)
    return state


def _give_back(device: int, held: list[Any]) -> None:
    """Clear the windows (torch's streams are pooled: the next user would inherit them) and
    the set-aside, when the pipeline is collected."""
    from engine.arena import l2 as arena_l2

    try:
        for stream in held:
            arena_l2.clear_window(device, int(stream.cuda_stream))
        arena_l2.reset(device)
    except Exception:  # at interpreter exit the CUDA runtime may be gone
        pass
