"""A CPU stand-in for ``torch.cuda.CUDAGraph`` that checks what a replay would get wrong.

Why: ``Pipeline(cuda_graphs="program")`` captures whole steps; CI has no GPU. The twin
implements the capture backend protocol of :mod:`engine.runtime.capture.synchronous`: ``capture(window)``
runs the window once under a dispatch recorder (the recording), and every ``replay()`` runs
the window's Python again under a recorder and compares the two recordings with the capture
audit's checks (:func:`engine.runtime.capture.audit.compare_recordings`): the same aten calls
with the same constants, every tensor from outside the window at the same address, no host
read. A difference raises :class:`ReplayDivergence` -- it is what a real graph would have
replayed wrongly, silently. ``reruns_host = True`` tells the capture layer that the window's
host bookkeeping ran again; it undoes it and applies the captured difference, exactly as after
a CUDA replay, so the pipeline's counters are checked too.

The one host read tolerated is engine.optim's CPU reference path reading ``found_inf``
(``engine/optim/functional.py:_skip``): on CUDA the fused kernels read it on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from engine.runtime.capture.audit import compare_recordings
from engine.runtime.capture.dispatch_trace import OpRecord, Recorder, _tensors, is_view, returns_fresh

__all__ = ["RecordingTwin", "ReplayDivergence", "TapeTwin"]

REFERENCE_SKIP = "engine/optim/functional.py:_skip"


class ReplayDivergence(AssertionError):
    """A replay made other calls, touched other outside memory, or read the host."""


class _Pool(Recorder):
    """A recorder that, like a graph's private memory pool, gives every value made inside
    the window the capture's tensor: at capture it keeps each op's fresh outputs; at a
    replay it copies the op's new outputs into them and hands those on (so the window's
    Python, and whoever holds a capture's output such as the loss, sees the replay's values
    in the capture's memory)."""

    def __init__(self, kept: list[list[Tensor] | None] | None = None) -> None:
        super().__init__()
        self.replaying = kept is not None
        self.kept: list[list[Tensor] | None] = kept if kept is not None else []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        fresh = returns_fresh(func)
        k = len(self.ops)
        if not self.replaying:
            self.kept.append(_tensors(out) if fresh else None)
        elif fresh and k < len(self.kept) and self.kept[k] is not None:
            made, old = _tensors(out), self.kept[k]
            if isinstance(out, Tensor) and len(old) == 1 and _same_meta(out, old[0]):
                old[0].copy_(out)
                out = old[0]
            elif isinstance(out, (tuple, list)) and len(made) == len(old) == len(out) and all(
                    isinstance(a, Tensor) and _same_meta(a, b) for a, b in zip(out, old, strict=True)):
                for a, b in zip(out, old, strict=True):
                    b.copy_(a)
                out = type(out)(old)
        self._record(func, args, kwargs, out)
        return out


def _same_meta(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() and a.device == b.device


class RecordingTwin:
    """The capture backend for CPU tests (module docstring); counts captures and replays."""

    reruns_host = True

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, window: Callable[[], None]) -> Callable[[], None]:
        first = _Pool()
        with first:
            window()
        self.captures += 1
        _no_host_reads(first.ops, "capture")

        def replay() -> None:
            again = _Pool(first.kept)
            with again:
                window()
            self.replays += 1
            found = [f for f in compare_recordings(first.ops, again.ops, previous=first.allocated)
                     if f.reason != REFERENCE_SKIP]
            if found:
                lines = "\n".join(f"  {f.check}: op {f.op}: {f.detail}" for f in found[:5])
                raise ReplayDivergence(f"replay {self.replays} differs from its capture "
                                       f"({len(found)} findings):\n{lines}")

        return replay


def _no_host_reads(ops: list[OpRecord], what: str) -> None:
    bad = [op for op in ops if op.sync is not None and op.where != REFERENCE_SKIP]
    if bad:
        raise ReplayDivergence(f"the {what} reads the host: {bad[0].name} {bad[0].sync} "
                               f"from {bad[0].where}")


class _Tape(TorchDispatchMode):
    """Keeps every aten call that launches work, with its very tensors: what a CUDA graph
    keeps of a capture (kernels with their pointers)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any], list[Tensor] | None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not is_view(func):
            fresh = returns_fresh(func)
            # aliases of the memory each argument names *now* (a kernel's pointers): a
            # parameter's ``.data`` is re-pointed between buffers later, which a graph
            # never sees
            frozen = tree_map(_alias, (args, kwargs))
            self.calls.append((func, *frozen, _tensors(out) if fresh else None))
        return out


def _data(x: Any) -> Any:
    return x.data if isinstance(x, Tensor) else x


def _alias(x: Any) -> Any:
    return x.detach() if isinstance(x, Tensor) else x


class TapeTwin:
    """A capture backend for CPU tests that replays like a CUDA graph: ``capture(window)``
    runs the window once (``runs_at_capture``: the capture's step is done) and keeps its
    aten calls with their tensors; ``replay()`` re-executes those calls on the same tensors
    -- a call that made a tensor writes its new value into the captured one, an in-place
    call writes where it wrote -- and runs no Python of the window. So whatever the host
    must do after a replay (the capture layer's bookkeeping), it must do itself, exactly as
    after a CUDA replay. Needs every write to go through aten (``PE_CPU_LOOP=0``) and no
    random ops (a CUDA graph would advance its generator's offset instead)."""

    runs_at_capture = True
    reruns_host = False

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, window: Callable[[], None]) -> Callable[[], None]:
        tape = _Tape()
        with tape:
            window()
        self.captures += 1
        calls = tape.calls

        def replay() -> None:
            with torch.no_grad():
                for func, args, kwargs, made in calls:
                    # on .data: a kernel bumps no autograd version counter, nor may the twin
                    a, kw = tree_map(_data, (args, kwargs))
                    out = func(*a, **kw)
                    if made is not None:
                        for new, old in zip(_tensors(out), made, strict=True):
                            old.data.copy_(new)
            self.replays += 1

        return replay
